"""The task entry point: submitit's own `_submit`, with hpcrun's stop flag installed first.

A signal that arrives while Python and submitit start (SLURM sends USR2 up to its 30 s check
period early, so a short or just-requeued job can get it at once) would otherwise kill the task
by default action, and the job would fail instead of checkpointing and requeueing. submitit's
handlers are replaced by the flag: hpcrun stops at a step boundary, collectively."""

from __future__ import annotations

from hpcrun.signals import FLAG

FLAG.install()


def main() -> None:
    from submitit.core import job_environment
    from submitit.core.submission import submitit_main

    job_environment.JobEnvironment._handle_signals = lambda self, paths, submission: FLAG.install()  # type: ignore[method-assign]
    submitit_main()


if __name__ == "__main__":
    main()
