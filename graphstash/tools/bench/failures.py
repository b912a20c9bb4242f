"""One line saying why a benchmark run failed, for the table that reports it beside the runs
that worked (``bench moe``, ``bench hf``: a refused capture is a result, not a crash)."""
from __future__ import annotations


def describe(exc: BaseException) -> str:
    """``"<type>(<cause>): <first line of the message>"``: the exception's type, the cause a
    :class:`~graphstash.CaptureError` names (``host_sync``, ``compile``, ...), and the first
    line of its message.

    Example::

        describe(ValueError("x: expected 3, got 4\\nmore"))    # "ValueError: x: expected 3, got 4"
    """
    if not isinstance(exc, BaseException):
        raise TypeError(f"exc: expected an exception, got {type(exc).__name__}")
    lines = str(exc).strip().splitlines()
    cause = getattr(exc, "cause", None)
    kind = type(exc).__name__ + (f"({cause})" if isinstance(cause, str) and cause else "")
    return f"{kind}: {lines[0].strip()}" if lines else kind
