"""Generated code of ``proto/lmserve/v1/lmserve.proto`` (``make proto``); do not edit the ``lmserve_pb2*`` files."""
