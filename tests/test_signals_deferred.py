"""signals.deferred: a signal that arrives while the loggers are being closed (after results.json is
written) waits for the close, then reaches the handler from before (a second SIGTERM once cut
wandb.finish off with the default action, and the CSV logger after it)."""
import os
import signal
import types

from normlab.signals import deferred


def test_a_signal_inside_the_block_reaches_the_old_handler_after_it():
    got, order = [], []
    old = signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
    try:
        with deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            order.append(list(got))  # nothing handled inside
        order.append(list(got))
        assert order == [[], [signal.SIGTERM]]
        os.kill(os.getpid(), signal.SIGTERM)  # the old handler is back
        assert got == [signal.SIGTERM] * 2
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_same_signal_twice_inside_the_block_is_handled_at_once():
    """A close that hangs still stops: the second Ctrl-C / SIGTERM reaches the old handler then."""
    got, order = [], []
    old = signal.signal(signal.SIGINT, lambda n, f: got.append(n))
    try:
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)
            order.append(list(got))
            os.kill(os.getpid(), signal.SIGINT)
            order.append(list(got))
        assert order == [[], [signal.SIGINT]] and got == [signal.SIGINT]  # once, as the OS would merge them
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_repeated_signal_reaches_a_raising_handler_once_each(monkeypatch):
    """An old handler that raises (Python's SIGINT default, submitit's requeue-then-exit): the second
    signal reaches it at once and the held first one is not raised again on the way out."""
    class Stop(Exception):
        pass

    calls = []

    def handler(n, f):
        calls.append(n)
        raise Stop

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        try:
            with deferred():
                os.kill(os.getpid(), signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGUSR1)
        except Stop as e:
            assert e.__context__ is None  # one exception, not a second raised while the first unwinds
        assert calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_finish_loggers_closes_the_wandb_run_before_a_signal_is_handled(monkeypatch):
    import wandb

    from normlab import loggers

    events = []
    run = types.SimpleNamespace(summary={}, offline=False)  # an online run: no sync note
    monkeypatch.setattr(wandb, "run", run, raising=False)

    def finish(exit_code=0):
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM while W&B closes the run
        events.append(("finished", exit_code))

    monkeypatch.setattr(wandb, "finish", finish)
    WandbLogger = type("WandbLogger", (), {})
    csv = types.SimpleNamespace(finalize=lambda status: events.append(("csv", status)))  # closed after W&B
    old = signal.signal(signal.SIGTERM, lambda n, f: events.append(("SIGTERM", n)))
    try:
        loggers.finish_loggers([WandbLogger(), csv], {"status": "completed", "test_bleu": 1.0})
    finally:
        signal.signal(signal.SIGTERM, old)
    assert events == [("finished", 0), ("csv", "success"), ("SIGTERM", signal.SIGTERM)]
    assert run.summary == loggers.wandb_summary({"status": "completed", "test_bleu": 1.0})  # written before the close
