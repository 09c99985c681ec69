"""Under torchrun: the ranks of a run that saw different signals agree on one.

The scenarios come as JSON on the command line: a list of scenarios, each a list (one per
rank) of the signal names that rank sends itself. For each, every rank sums the votes over
the real process group and decides; rank r writes its decisions to OUT/rank<r>.json.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch

from ciuic_train.config import DistConfig
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.train.stop_request import StopRequest


def main(out: str, scenarios: str) -> None:
    parallel = Parallel(DistConfig(), torch.device("cpu"), n_routed_experts=0)
    rank, decisions = parallel.info.rank, []
    for signals_of_rank in json.loads(scenarios):
        with StopRequest() as stop:
            for name in signals_of_rank[rank]:
                os.kill(os.getpid(), getattr(signal, name))
            decisions.append(StopRequest.decide(parallel.sum(stop.votes())))
    Path(out, f"rank{rank}.json").write_text(json.dumps(decisions))
    parallel.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
