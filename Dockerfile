# attnserve container image, two stages on Debian 12 (bookworm):
#   build    compiles attnserve and attnctl with scripts/build and runs the unit tests;
#   runtime  the two binaries, their runtime shared libraries and nothing else (no compiler),
#            run as an unprivileged user.
#
#   docker build -t attnserve:0.1.0 .
#   buildah bud --format docker --build-arg BASE_IMAGE=localhost/attnserve-base:bookworm \
#     -t attnserve:0.1.0 .          # scripts/image-test builds and runs it this way
#   docker run -p 50051:50051 -p 9464:9464 attnserve:0.1.0 [attnserve flags...]
#
# Use the docker image format (buildah: --format docker): the OCI format has no HEALTHCHECK.
# docs/deploy.md has the details.

# Any Debian 12 image: debian:bookworm-slim from a registry, or a local one made by
# scripts/debian-base-image where no registry is reachable.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS build
ARG DEBIAN_FRONTEND=noninteractive
# The build subset of scripts/install-deps: no benchmark library (benchmarks are off here) and
# none of the tools that only the script tests use (Prometheus, Python, buildah, node); openssl
# makes the TLS test's certificates, libssl-dev lets the server check its TLS files,
# zlib1g-dev lets it inflate compressed requests with a bound; libpng-dev and nlohmann-json3-dev
# are attnctl's PNG and JSON writers.
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends \
        build-essential cmake pkg-config \
        libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto \
        libabsl-dev libdnnl-dev prometheus-cpp-dev libgtest-dev libgmock-dev \
        ocl-icd-opencl-dev opencl-c-headers openssl libssl-dev zlib1g-dev \
        libpng-dev nlohmann-json3-dev \
    && rm -rf /var/lib/apt/lists/*
# The commit `attnserve --version` names: the build context has no .git (scripts/image-test
# passes git's short hash).
ARG ATTNSERVE_GIT_COMMIT=
WORKDIR /src
COPY . .
# No Python here: the Python package and its tests are built and run on the host.
RUN scripts/build -DATTNSERVE_BUILD_BENCHMARKS=OFF -DATTNSERVE_BUILD_PYTHON=OFF \
        -DATTNSERVE_GIT_COMMIT="${ATTNSERVE_GIT_COMMIT}"
# The unit tests: every GoogleTest case (ctest names them Suite.Case). The script tests, named
# *_test, need tools this stage does not carry (Prometheus, Python, buildah, kubectl, node) or
# test the image itself; CI runs them on the host.
RUN ctest --test-dir build --output-on-failure -j "$(nproc)" -E '_test$' \
    && strip --strip-unneeded build/server/attnserve build/client/attnctl

FROM ${BASE_IMAGE} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
# The shared libraries attnserve and attnctl link (ldd; apt adds their own dependencies).
# libdnnl2 is built with the OpenCL GPU runtime, so it needs the OpenCL loader even though
# attnserve only creates CPU engines.
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends \
        libgrpc++1.51 libprotobuf32 libabsl20220623 \
        libdnnl2 ocl-icd-libopencl1 libgomp1 \
        libprometheus-cpp-core1.0 libssl3 zlib1g libpng16-16 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
RUN groupadd --system --gid 10001 attnserve \
    && useradd --system --uid 10001 --gid attnserve --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin attnserve
COPY --from=build /src/build/server/attnserve /src/build/client/attnctl /usr/local/bin/
COPY --from=build /src/scripts/container-entrypoint /usr/local/bin/attnserve-entrypoint
# Fails the build if a shared library is missing from the list above.
RUN missing=$(ldd /usr/local/bin/attnserve /usr/local/bin/attnctl | grep 'not found' || true) \
    && if [ -n "${missing}" ]; then echo "missing shared libraries:" "${missing}"; exit 1; fi

LABEL org.opencontainers.image.title="attnserve" \
      org.opencontainers.image.description="Multi-head attention as a gRPC service (oneDNN, CPU)"
# A numeric user, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# gRPC (attnserve.v1, grpc.health.v1, reflection) and Prometheus /metrics.
EXPOSE 50051 9464
# attnctl health exits 0 on SERVING. It checks port 50051, or ATTNSERVE_PORT when the port is
# set that way (attnserve reads any flag from ATTNSERVE_<FLAG>); plaintext only.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD attnctl --target="127.0.0.1:${ATTNSERVE_PORT:-50051}" --timeout=5s health || exit 1
# Sets OMP_NUM_THREADS from the CPU quota unless it is set, then execs attnserve "$@".
ENTRYPOINT ["/usr/local/bin/attnserve-entrypoint"]
