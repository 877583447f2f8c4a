# attnserve in a container: a build stage compiles the server and the client on Debian 12, the
# runtime stage carries the two binaries and their runtime libraries only, as a non-root user.
#
#   deploy/docker-build.sh                            (docker or podman; see there)
#   podman run --rm -p 50051:50051 -p 8000:8000 attnserve   (the built-in demo model; REST on 8000)
#   podman run --rm -p 50051:50051 -v /path/to/my.safetensors:/models/my.safetensors:ro \
#     attnserve --listen 0.0.0.0:50051 --model my=/models/my.safetensors:num_heads=8
#
# The build stage starts from debian:bookworm (BUILD_IMAGE); deploy/docker-build.sh passes
# debian:bookworm-slim where only that is present: install-deps.sh installs everything the build
# needs either way. Built with podman, keep `--format docker`: OCI images drop the HEALTHCHECK.
ARG BUILD_IMAGE=debian:bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
# The dependency layer first, so that a source change does not reinstall the toolchain.
COPY deploy/install-deps.sh deploy/install-deps.sh
RUN deploy/install-deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B /build -DCMAKE_BUILD_TYPE=Release -DATTNSERVE_BUILD_TESTS=OFF \
 && cmake --build /build -j"$(nproc)" --target attnserve attnserve-client \
 && strip /build/server/attnserve /build/client/attnserve-client

FROM ${RUNTIME_IMAGE}
# The shared libraries the two binaries link (found with ldd + dpkg -S); apt adds what they
# depend on (libgrpc29, abseil, c-ares, re2, OpenSSL, zlib). libssl-dev for one file: civetweb
# loads OpenSSL at run time as "libssl.so", the name only the -dev package installs (TLS on
# the REST port).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      libdnnl2 ocl-icd-libopencl1 libgomp1 \
      libgrpc++1.51 libprotobuf32 libspdlog1.10 libfmt9 \
      libprometheus-cpp-core1.0 libcivetweb1 libsimdjson14 libssl-dev \
 && rm -rf /var/lib/apt/lists/*
# Nothing in the image is world-writable (the base's /tmp, /var/tmp and /run/lock are): the server
# writes no files but an optional --port-file, so a compromised process has nowhere to drop one.
# The same uid and gid (10001) as USER below and the Kubernetes securityContext (runAsUser,
# runAsGroup, fsGroup in deploy/k8s): useradd's --user-group alone would pick a system gid,
# leaving files owned by a group USER does not name. A system account past Debian's system range
# (SYS_UID_MAX 999), which useradd warns about unless the range is widened for this call (-K);
# --no-log-init writes no lastlog/faillog entry.
RUN groupadd --system --gid 10001 attnserve \
 && useradd --system -K SYS_UID_MAX=10001 --uid 10001 --gid 10001 --no-log-init \
      --no-create-home --shell /usr/sbin/nologin attnserve \
 && mkdir /models \
 && find / -xdev -perm -o+w ! -type l -exec chmod o-w {} + \
 && test -z "$(find / -xdev -perm -o+w ! -type l)"
COPY --from=build /build/server/attnserve /build/client/attnserve-client /usr/local/bin/
USER 10001:10001
# Weights are mounted here (read-only is enough); without --model the demo layer is served.
WORKDIR /models
EXPOSE 50051 8000 8002 8081
# The HEALTHCHECK asks the plaintext health-only port, so it keeps working when the main port
# serves TLS or asks for tokens; arguments that replace CMD should keep --health-listen.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["attnserve-client", "--target", "127.0.0.1:8081", "--timeout", "3", "--no-retry", "health"]
ENTRYPOINT ["attnserve"]
CMD ["--listen", "0.0.0.0:50051", "--health-listen", "0.0.0.0:8081"]
