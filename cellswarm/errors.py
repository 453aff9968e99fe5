"""One exception hierarchy for cellswarm; boundaries (CLI, HTTP) map it to one-line messages.

    CellswarmError
    ├── ModelFileError        a model file is unreadable, truncated, corrupt or inconsistent
    │   ├── UnsupportedArchitectureError
    │   ├── UnsupportedQuantError
    │   ├── MissingTensorError
    │   ├── ShapeMismatchError
    │   └── NonFiniteError    a weight, or the activations it made, NaN or infinite
    ├── TokenizerError        tokenizer missing or disagreeing with the model
    ├── BudgetError           something does not fit in a byte budget (says by how much)
    ├── RequestError          a caller asked for something invalid (bad option, bad value)
    │   └── JobError              a job's own data makes a stage fail (its attempt, not the node)
    ├── ProtocolError         a peer sent a malformed, oversized or corrupt frame
    │   └── ChunkMismatchError    a fetched chunk of a model file does not match its manifest
    ├── SwarmError            the swarm cannot finish: retries spent, a stage offline
    ├── StorageFullError      a disk the coordinator writes (its database) is full
    └── LabError              the lab cannot run here (not root, no namespaces) or failed

Every message names the offending value and, where there is one, the fix.
"""


class CellswarmError(Exception):
    """Base of every error cellswarm raises on purpose."""


class ModelFileError(CellswarmError):
    """A model file (GGUF or Hugging Face folder) cannot be used as it is."""


class UnsupportedArchitectureError(ModelFileError):
    pass


class UnsupportedQuantError(ModelFileError):
    pass


class MissingTensorError(ModelFileError):
    pass


class ShapeMismatchError(ModelFileError):
    pass


class NonFiniteError(ModelFileError):
    """A weight's scale or value is NaN or infinite, or activations became so where a layer
    ran: the message names the layer and tensor; the file is most likely corrupt."""


class TokenizerError(CellswarmError):
    pass


class BudgetError(CellswarmError):
    """Something does not fit in a byte budget; the message says by how many bytes."""


class RequestError(CellswarmError):
    pass


class StorageFullError(CellswarmError):
    """The coordinator's database cannot grow: its disk is full. Nothing acknowledged is
    lost (the write that failed was not acknowledged); it works again once space returns.
    HTTP: 507."""


class DatabaseDamagedError(CellswarmError):
    """The coordinator's database file fails its integrity check: restore it or move it."""


class JobError(RequestError):
    """A job's own data cannot be run where it got to (a sampling parameter the engine
    refuses, say): that job's attempt fails; the node that found out is not to blame."""


class ProtocolError(CellswarmError):
    """A peer sent something that is not a valid frame; the connection is dropped."""


class ChunkMismatchError(ProtocolError):
    """A fetched chunk of a model file has another length or sha256 than its manifest says."""


class SwarmError(CellswarmError):
    """Bounded retries ran out, or a stage failed too often to keep in the placement."""


class LabError(CellswarmError):
    """`cellswarm lab` cannot run on this machine (not root, no namespaces, ...) or failed."""
