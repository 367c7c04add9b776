"""``python -m kvproxy.sim``: the simulator on its own, without the kvproxy CLI."""

import argparse

from kvproxy.sim.launcher import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m kvproxy.sim", description=__doc__)
add_arguments(parser)
raise SystemExit(run(parser.parse_args()))
