"""One rank of tests/test_any_size.py's check of initialization from scratch:
`initialize_rank.py OUT OVERRIDE...` under torchrun builds the Trainer of the overrides
(the meta build, then this rank's rows drawn), and writes this rank's peak resident
memory (VmHWM) to OUT/rank{RANK}.json."""

import json
import os
import sys
from pathlib import Path

from conftest import compose_config
from ciuic_train.memory_limits import peak_resident_bytes
from ciuic_train.train.trainer import Trainer

if __name__ == "__main__":
    out = Path(sys.argv[1])
    trainer = Trainer(compose_config(*sys.argv[2:]), out)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps({"peak_resident_bytes": peak_resident_bytes()}))
    trainer.parallel.close()
