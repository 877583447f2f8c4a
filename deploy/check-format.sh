#!/usr/bin/env bash
# The formatting check (deploy/test.sh runs it first, before the build): clang-format-14 with the
# repository's .clang-format over every tracked *.cc and *.h. Changes nothing and installs nothing
# (deploy/install-deps.sh --test installs clang-format-14).
#   deploy/check-format.sh           exit 0 when every file is formatted; else lists the files
#                                    that differ and exits 1 (2: no clang-format-14)
#   deploy/check-format.sh --diff    also shows how each file differs
# To format them: clang-format-14 -i --style=file FILE...
# The exact version on purpose: another clang-format formats some constructs differently.
# Generated sources (protoc's, under build*/) and third-party code are not tracked, so nothing is
# excluded; should such a file ever be committed, leave it out in `files` below.
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format-14}
show_diff=0
for arg in "$@"; do
  case "$arg" in
    --diff) show_diff=1 ;;
    -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "check-format.sh: unknown argument '$arg' (--diff, --help)" >&2; exit 2 ;;
  esac
done
command -v "$CLANG_FORMAT" >/dev/null ||
  { echo "check-format.sh: no $CLANG_FORMAT (deploy/install-deps.sh --test installs it)" >&2; exit 2; }

# Tracked files only; one deleted in the work tree but not yet in the index is skipped.
files=()
while IFS= read -r -d '' f; do
  [[ -f "$f" ]] && files+=("$f")
done < <(git ls-files -z -- '*.cc' '*.h')
(( ${#files[@]} )) || { echo "check-format.sh: no tracked *.cc or *.h file" >&2; exit 2; }

differ=()
for f in "${files[@]}"; do
  "$CLANG_FORMAT" --style=file --dry-run --Werror "$f" >/dev/null 2>&1 || differ+=("$f")
done
if (( ${#differ[@]} == 0 )); then
  echo "format: all ${#files[@]} files as $CLANG_FORMAT --style=file formats them"
  exit 0
fi
echo "format: ${#differ[@]} of ${#files[@]} files differ from $CLANG_FORMAT --style=file:" >&2
printf '  %s\n' "${differ[@]}" >&2
if (( show_diff )); then
  for f in "${differ[@]}"; do
    "$CLANG_FORMAT" --style=file "$f" | diff -u --label "a/$f" --label "b/$f" "$f" - >&2 || true
  done
else
  echo "(deploy/check-format.sh --diff shows how; $CLANG_FORMAT -i --style=file FILE... formats)" >&2
fi
exit 1
