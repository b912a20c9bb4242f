"""Exceptions graphstash raises for its own failures.

Bad arguments raise the built-in ``TypeError`` / ``ValueError`` naming the argument;
everything below is a failure of graphstash's own state or environment.
"""


class GraphstashError(RuntimeError):
    """Base class of graphstash's own failures."""


class CaptureError(GraphstashError):
    """An operation that would break (or was broken by) a CUDA graph capture.

    ``cause`` says what happened when :func:`graphstash.graph_step` read it from a failed
    capture (one of ``graphstash.graph.capture_errors.CAUSES``: ``"compile"``,
    ``"host_sync"``, ...); None where graphstash refused an operation itself."""

    def __init__(self, *args, cause: str | None = None):
        super().__init__(*args)
        self.cause = cause


class BackendUnavailableError(GraphstashError):
    """The requested backend (for example the CuPy kernels) cannot run here."""


class ExchangeError(GraphstashError):
    """An expert-parallel exchange failed: a peer did not signal within the transport's
    timeout (it died, raised, or runs another sequence of exchanges), or its counts' header
    disagreed with this rank's (another budget, expert count, padding or row width)."""


class PoolExhaustedError(GraphstashError):
    """An eager operation needed more pages or handle slots than the pool holds."""


class StaleHandleError(GraphstashError):
    """A handle used after its buffer was reset, released, or after it was reloaded."""


class ReleasedError(GraphstashError):
    """An object used after ``release()`` and before ``reallocate()`` / ``reset()``."""


class UpdateAppliedError(GraphstashError):
    """A call failed after its step's optimizer update was applied: the step is counted in
    ``stats.steps`` and its batch must not be run again (that would apply it twice)."""


class SavedTensorsError(GraphstashError):
    """A saved-tensor context (``stash_activations``, ``ActivationOffloader``, a swap scope,
    ``with manager:``) used wrongly: nested inside another, exited out of order, a group misused."""



class SavedTensorModifiedError(SavedTensorsError):
    """A tensor saved for backward was modified in place before backward used it."""


class StashOverflowError(GraphstashError):
    """An eager step stashed more than the pool holds: its reloaded tensors, and so its
    gradients, are wrong (see ``StashManager(eager_overflow=...)``)."""


class OverBudgetError(GraphstashError):
    """An eager step's MoE dispatch routed more rows than its static budget and dropped the
    rest: its outputs and gradients differ from a dropless step (see
    ``StashManager(eager_overflow=...)``)."""
