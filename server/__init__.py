"""lm-serve: the gRPC service over ``rescoring`` (see README.md in this folder)."""

import os

# ONNX Runtime's telemetry, on by default, writes under $HOME at import, and where it cannot (a read-only root file
# system, as in our pods) prints a coloured warning: the one log line of lm-serve that was not JSON. The server's
# process, its replicas and its scoring processes inherit this before any of them imports onnxruntime.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
