#!/usr/bin/python3
"""ctest driver: runs client/python/version_swap.py against a real attnserve serving a temporary
repository in explicit mode (two fixtures of the same shape as versions 1 and 2): every call is
answered, by both versions over the run, none fails, and the rollback leaves version 1 ready.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_example_test import start_server  # noqa: E402  (the same helper)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--stubs", required=True)
    parser.add_argument("--example", required=True)
    parser.add_argument("--fixtures", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        repo = os.path.join(workdir, "repo")
        for version, fixture in ((1, "w_fused_mh.safetensors"), (2, "w_torch_mha.safetensors")):
            os.makedirs(os.path.join(repo, "enc", str(version)))
            shutil.copy(os.path.join(args.fixtures, fixture),
                        os.path.join(repo, "enc", str(version), "model.safetensors"))
        proc, target = start_server(args.server, workdir, [], extra=[
            "--model-repository", repo, "--model-control-mode", "explicit", "--load-model", "enc"])
        try:
            run = subprocess.run([sys.executable, args.example, "--target", target, "--model", "enc",
                                  "--versions", "1,2", "--swaps", "4", "--stubs", args.stubs],
                                 capture_output=True, text=True, timeout=120)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        print(run.stdout, run.stderr)
        if run.returncode != 0:
            sys.exit(f"version_swap.py exited {run.returncode}")
        last = run.stdout.strip().splitlines()[-1]
        if "version 1:" not in last or "version 2:" not in last or not last.endswith(" 0 failed"):
            sys.exit(f"expected answers from both versions and no failure: {last}")
        if "rolled back: ready versions [1]" not in run.stdout:
            sys.exit("the rollback did not leave version 1 ready")
    print("ok")


if __name__ == "__main__":
    main()
