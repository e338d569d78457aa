"""lmserve: LSTM language models for large vocabularies — training, n-best/k-best rescoring and a gRPC service.

One import package, so that an installation puts ``lmserve`` alone into site-packages (generic names such as
``server`` or ``training`` would shadow, or be shadowed by, other projects'):

- ``lmserve.training``  (the repository's ``training/``: the only part that imports torch; ``lm-train``),
- ``lmserve.rescoring`` (``rescoring/``: the torch-free engine and the lm-serve client; ``lm-rescore``),
- ``lmserve.server``    (``server/``: the gRPC shell over the engine; ``lm-serve``),
- ``lmserve.v1``        (the generated code of the wire contract ``proto/lmserve/v1/lmserve.proto``, at the import
  path protoc gives it, shared by the client and the server).

The three parts stay top-level folders of the repository; in it, ``lmserve/training`` and its siblings are relative
symbolic links to them, so any checkout (a clone, a ``git worktree``) imports its own code as ``lmserve.…`` with the
checkout on ``sys.path`` and nothing installed. A wheel does not depend on the links: pyproject.toml maps each package
to its folder.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lmserve")
except PackageNotFoundError:  # a checkout on sys.path that was never installed
    __version__ = "0+unknown"
