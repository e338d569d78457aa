#!/bin/sh
# The lm-serve image's entry point: `lm-serve serve` with the config file $LMSERVE_CONFIG, and the address, ports and
# log level from the environment where they are set (they override the config file's [server] host, port and
# metrics_port). Arguments given to the container come last, e.g. --replicas 2. exec: lm-serve is PID 1 and gets
# SIGTERM itself (health NOT_SERVING, calls in flight drained for grace_seconds, exit 0).
#
#   LMSERVE_CONFIG        the server's TOML config (default /etc/lmserve/serve.toml)
#   LMSERVE_HOST          address to bind (the image sets 0.0.0.0)
#   LMSERVE_PORT          gRPC port (the image sets 50051; the HEALTHCHECK calls it on 127.0.0.1)
#   LMSERVE_METRICS_PORT  Prometheus /metrics port (-1: off)
#   LMSERVE_LOG_LEVEL     debug, info (default), warning or error
set -eu
exec lm-serve serve --config "${LMSERVE_CONFIG:-/etc/lmserve/serve.toml}" \
    ${LMSERVE_HOST:+--host "$LMSERVE_HOST"} \
    ${LMSERVE_PORT:+--port "$LMSERVE_PORT"} \
    ${LMSERVE_METRICS_PORT:+--metrics-port "$LMSERVE_METRICS_PORT"} \
    --log-level "${LMSERVE_LOG_LEVEL:-info}" "$@"
