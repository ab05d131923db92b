"""How the producer's failures reach `train()`.

A user's own exception (an environment's factory or `reset`, a `rollout_func`, a dataset row naming an unknown
environment) reaches `train()` as itself, as GRPOTrainer raises it there, so that `except ValueError` keeps working
when only the import changes; a note says where the producer was. A failure of our own machinery (a server that stalls
or goes away, a weight push, a version label) is a `ProducerError`, the original as its `__cause__`. (A tool's error is
neither: TRL counts it as a failed call, and so does the producer.)
"""

from __future__ import annotations

import contextlib
import pickle


class ProducerError(RuntimeError):
    """The producer's own machinery failed; the original exception is the `__cause__`."""


class EpisodesStopped(BaseException):
    """The producer is stopping: an episode is abandoned. A BaseException, so that TRL's tool loop, which counts any
    Exception of a tool as a failed call, lets it end the episode."""


class VLLMServerUnreachable(ConnectionError):
    """The vLLM server does not answer at its address."""


class VLLMServerError(RuntimeError):
    """The server refused a request, reported a failure, stalled, or broke the protocol; the message says which."""


class VLLMServerSetupError(RuntimeError):
    """The server (or the trainer's environment) lacks what the chosen weight transport needs."""


_RAISED_BY = "_a3po_raised_by"  # on a user's exception: what of theirs raised it
_NOTED = "_a3po_noted"


@contextlib.contextmanager
def _raised_by(what: str | None):
    """Marks an exception raised inside with what raised it (None: our own machinery), unless an inner block did."""
    try:
        yield
    except Exception as error:
        if not hasattr(error, _RAISED_BY):
            setattr(error, _RAISED_BY, what)
        raise


def user_code(what: str):
    """Around a call into the user's code (or a check of the user's data) in the producer: its exception is theirs,
    unless it came from `our_code` within (the generation a `rollout_func` asks the producer for)."""
    return _raised_by(what)


def our_code():
    """Around our machinery called from within the user's code: its failures stay ours (a `ProducerError`)."""
    return _raised_by(None)


def is_users(error: BaseException) -> bool:
    return getattr(error, _RAISED_BY, None) is not None


def as_raised_in_train(error: BaseException, doing: str) -> BaseException:
    """What `train()` raises for the producer's `error`, caught while it was `doing` something: the user's exception
    itself, with a note (once), or a `ProducerError` from ours."""
    if not is_users(error):
        failure = ProducerError(f"the generation producer failed while {doing}: {error!r}")
        failure.__cause__ = error
        return failure
    if not getattr(error, _NOTED, False):
        error.add_note(f"(raised by {getattr(error, _RAISED_BY)}, in A-3PO's generation producer while {doing})")
        setattr(error, _NOTED, True)
    return error


def for_other_processes(error: BaseException) -> BaseException:
    """What the main process sends the processes it generates for when it fails: the user's exception itself where it
    survives pickling (its type, message and notes), else a `ProducerError` naming it."""
    if is_users(error):
        with contextlib.suppress(Exception):
            sent = pickle.loads(pickle.dumps(error))
            if type(sent) is type(error):
                return sent
    return ProducerError(f"the main process's generation failed: {error!r}")
