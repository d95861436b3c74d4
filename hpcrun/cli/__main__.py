"""`python -m hpcrun.cli`, the same as `hpcrun`."""

from hpcrun.cli import main

main(prog_name="hpcrun")
