"""`python tests/helpers/fault_worker.py ARGS...` runs `mlm train ARGS` with a fault injected on one
rank, for tests/distributed/test_resilience.py and tests/distributed/test_torchrun.py: MLM_TEST_FAULT="sleep,R,S" makes
rank R sleep (10 minutes) inside step S's forward-backward, "raise,R,S" makes it raise a
RuntimeError there, "kill,R,S" SIGKILLs it there in torchrun's first attempt only; unset, no
fault. The rank is the launcher's (RANK, or SLURM_PROCID under srun); S counts the steps this
process runs."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository, not tests/helpers/

from cli.main import main  # noqa: E402
from mlm.parallel.pipeline import Pipeline  # noqa: E402

if os.environ.get("MLM_TEST_FAULT"):
    kind, rank, step = os.environ["MLM_TEST_FAULT"].split(",")
    me = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    original = Pipeline.train_step
    calls = 0

    def train_step(self, *args, **kwargs):
        global calls
        calls += 1
        if me == int(rank) and calls == int(step):
            if kind == "kill" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "sleep":
                time.sleep(600)
            if kind in ("sleep", "raise"):
                raise RuntimeError(f"injected fault on rank {rank} in step {step}")
        return original(self, *args, **kwargs)

    Pipeline.train_step = train_step

if __name__ == "__main__":
    sys.argv = ["mlm", "train", *sys.argv[1:]]
    main()
