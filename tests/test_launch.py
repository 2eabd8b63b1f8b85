"""Launch detection: torchrun's variables, SLURM's, and SLURM's compressed node lists."""

from __future__ import annotations

from mlm.parallel.launch import detect, expand_nodelist


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_nodelist("node7") == ["node7"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_detect_torchrun_slurm_single():
    assert detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}).launcher == "torchrun"
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "n[3-4]",
        "SLURM_JOB_ID": "123456",
    }
    launch = detect(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (5, 8, 1, "slurm")
    assert env["MASTER_ADDR"] == "n3" and env["MASTER_PORT"] == str(20000 + 123456 % 20000)
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1"
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "single"
