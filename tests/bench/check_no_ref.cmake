# Runs attnserve_bench on every standard shape, f32 and bf16, with ONEDNN_VERBOSE=2 and fails when
# the log shows a oneDNN reference implementation, or a primitive created a second time (oneDNN's
# own cache logs that as create:cache_hit: each shape runs twice, so per-call creation shows), or
# the benchmark fails. Usage: cmake -DBENCH=... -P this.
set(ENV{ONEDNN_VERBOSE} 2)
foreach(precision f32 bf16)
  execute_process(
    COMMAND ${BENCH} --shapes bert,causal,ragged,cross,small,long --reps 1 --threads 2 --precision ${precision}
    OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "attnserve_bench --precision ${precision} failed (${rc}):\n${out}\n${err}")
  endif()
  string(REGEX MATCHALL "onednn_verbose,exec[^\n]*" execs "${out}")
  list(LENGTH execs n_exec)
  if(n_exec EQUAL 0)
    message(FATAL_ERROR "no oneDNN verbose exec lines: is ONEDNN_VERBOSE honoured?\n${out}")
  endif()
  foreach(line IN LISTS execs)
    if(line MATCHES "ref:|:ref|,ref,")
      message(FATAL_ERROR "oneDNN reference implementation used (${precision}):\n${line}")
    endif()
  endforeach()
  string(REGEX MATCHALL "onednn_verbose,create:cache_miss[^\n]*" creates "${out}")
  list(LENGTH creates n_create)
  string(REGEX MATCH "onednn_verbose,create:cache_hit[^\n]*" again "${out}")
  if(again)
    message(FATAL_ERROR "a oneDNN primitive was created again (${precision}):\n${again}")
  endif()
  message(STATUS "${precision}: ${n_exec} oneDNN executions of ${n_create} primitives, each "
                 "created once, none a reference implementation")
endforeach()
