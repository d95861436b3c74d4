"""The task entry point inside the allocation: `python -m hpcrun.launch <run dir>`.

A torch older than hpcrun supports (hpcrun.torchrange) is refused here, on every rank, with one
line and exit status 2; one newer than tested gets a warning line and runs.

The stop flag is installed before anything else is imported: SLURM may send USR2 as a task
starts (up to its 30 s check period early, so a short or just-requeued job can get it at once),
and the default action would kill the task instead of letting it checkpoint and requeue. A rank that dies
of a fatal signal (a library's abort or segfault) writes every thread's Python stack to its log first.
"""

from __future__ import annotations

from hpcrun.signals import FLAG

FLAG.install()

import faulthandler  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from hpcrun.runtime import standby  # noqa: E402

faulthandler.enable(all_threads=True)  # stderr: the rank's log


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpcrun.launch RUN_DIR", file=sys.stderr)
        return 2
    # The imports below make ~1.5M objects that live as long as the rank: no collection while they are made,
    # then frozen, out of every later collection's reach, the exit's included (~1 s of a core per rank)
    gc.disable()
    if os.environ.pop(standby.ENV, None):  # the next attempt's ranks, started early (hpcrun.runtime.standby)
        status = standby.wait(FLAG)
        if status is not None:
            return status
        print(f"[hpcrun] standby: becoming attempt {os.environ.get('HPCRUN_ATTEMPT')}", file=sys.stderr, flush=True)
    import torch  # the rank imports it next anyway; first its version decides whether the rank runs

    from hpcrun import torchrange

    found = torchrange.verdict(torch.__version__)
    if found.status == torchrange.REFUSED:  # one line, before the runtime imports what this torch may lack
        print(found.message, file=sys.stderr, flush=True)
        return 2
    if found.status == torchrange.NEWER:
        print(f"[hpcrun] warning: {found.message}", file=sys.stderr, flush=True)
    from hpcrun.rundir import RunDir
    from hpcrun.runtime.trainer import main as run_attempt

    gc.freeze()
    gc.enable()

    # a failure raises: the traceback goes to this rank's log and the exit status is non-zero
    try:
        run_attempt(str(RunDir(args[0]).spec))
    except Exception:
        # A failed rank (its exit record written, a survivor's state kept, where its attempt got that far):
        # the interpreter's teardown (the process group's destructors, ~1.3 s on the test cluster) would
        # only delay the step's end, which the restart waits for. The traceback goes to this rank's log.
        sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
