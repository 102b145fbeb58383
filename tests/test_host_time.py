"""tools/host_time.py on the CPU harness: every op's CUDA device path registered for the CPU with no-op kernels;
one eager sublayer step calls exactly the mHC chain's twelve ops, forward then backward, and each gets timed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAIN = ["mhc_gemm_with_sqrsum_forward", "mhc_reduce_partials_and_rmsnorm_forward", "mhc_pre_split_mixes_forward",
         "mhc_sinkhorn_forward", "mhc_pre_apply_mix_forward", "mhc_post_forward", "mhc_post_backward",
         "mhc_pre_apply_mix_backward", "mhc_sinkhorn_backward", "mhc_pre_split_mixes_backward",
         "mhc_reduce_partials_and_rmsnorm_backward", "mhc_gemm_with_sqrsum_backward"]


def test_host_time_times_the_chain_on_the_cpu_harness():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "host_time.py"), "--eager", "--steps", "2",
                           "--tokens", "3", "--hidden", "256", "--per-op"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("eager MHCSublayer step, T=3, H=256, cpu: host ")
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows[:-1]] == CHAIN
    assert all(float(value) > 0 for row in rows[:-1] for value in row[1:])
    assert rows[-1][:3] == ["all", "12", "calls"]
