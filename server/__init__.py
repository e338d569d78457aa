"""lm-serve: the gRPC service over ``rescoring`` (see README.md in this folder)."""
