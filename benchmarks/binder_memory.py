"""Peak memory of the course as Binder runs it: the Jupyter server, plus a kernel and every process below it.

    python benchmarks/binder_memory.py                        # 9 rounds, writes benchmarks/results/binder_memory.*
    python benchmarks/binder_memory.py --rounds 3 --notebooks 09_model_parallelism_and_ddp

mybinder.org gives a session 1 to 2 GB, and kills the kernel (or the session) beyond it. What has to fit:
the Jupyter server, the notebook's kernel, and whatever the kernel starts: `launch`'s ranks (4 in every
notebook) and, in notebook 09, a torchrun cell (torchrun's agent and its workers, fresh interpreters).

How: each notebook runs top to bottom in a fresh kernel (nbclient, this interpreter, cwd notebooks/ as
in JupyterLab), while a thread samples, every 20 ms, every process in the kernel's tree and sums
  * PSS (/proc/PID/smaps_rollup): each page shared by n processes counts 1/n in each, so the sum is what
    the processes occupy together; forked ranks share most of the kernel's pages, so this is the figure
    to hold against the limit (the container's memory cgroup counts pages once, like PSS);
  * RSS: shared pages counted in every process, a pessimistic bound, as benchmarks/launch_cost.py also prints.
The peak of each sum is kept with the cell that was running. The Jupyter server (JupyterLab, when
installed: requirements/course.txt) is started alone on 127.0.0.1 and its PSS/RSS read once it answers.
Notebooks and the server are interleaved round by round; medians and min..max over the rounds are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ["04_ring_scatter_reduce", "07_data_parallel_training", "09_model_parallelism_and_ddp"]
MIB = 1024  # smaps_rollup is in KiB


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB, (0, 0) if it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def process_tree(root: int) -> list[int]:
    """`root` and every live process below it."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    tree, frontier = [root], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        tree += children
        frontier += children
    return tree


def _what(pid: int, kernel: int) -> str:
    """A short name for a process in the kernel's tree."""
    if pid == kernel:
        return "kernel"
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            words = [w for w in f.read().split("\0") if w]
    except OSError:
        words = []
    if not words:
        return "exiting process"
    text = " ".join(words)
    for needle, name in (("ipykernel_launcher", "forked rank"), ("torch.distributed.run", "torchrun agent"),
                         ("spawn_main", "spawned rank"), ("resource_tracker", "resource tracker")):
        if needle in text:
            return name
    return os.path.basename(next((w for w in words[1:] if w.endswith(".py")), words[0]))


class PeakSampler(threading.Thread):
    """Samples the summed RSS and PSS of a process tree until stopped; keeps the peaks."""

    def __init__(self, interval=0.02):
        super().__init__(daemon=True)
        self.interval, self.root, self.cell = interval, None, None
        self.peak = {"pss_kib": 0, "rss_kib": 0, "processes": 0, "pss_cell": None}
        self._done = threading.Event()

    def run(self):
        while not self._done.wait(self.interval):
            if self.root is None:
                continue
            tree = process_tree(self.root)
            usage = [memory_kib(pid) for pid in tree]
            rss, pss = sum(u[0] for u in usage), sum(u[1] for u in usage)
            if pss > self.peak["pss_kib"]:
                self.peak.update(pss_kib=pss, pss_cell=self.cell, processes_at_pss_peak=len(tree),
                                 pss_by_process=[[_what(pid, self.root), u[1]] for pid, u in zip(tree, usage)])
            self.peak["rss_kib"] = max(self.peak["rss_kib"], rss)
            self.peak["processes"] = max(self.peak["processes"], len(tree))

    def stop(self):
        self._done.set()
        self.join()


def notebook_peak(name: str) -> dict:
    import nbformat
    from nbclient import NotebookClient

    path = ROOT / "notebooks" / f"{name}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    sampler = PeakSampler()
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})

    def on_cell_start(cell, cell_index, **_):
        sampler.root = client.km.provisioner.process.pid
        sampler.cell = cell_index

    def on_cell_complete(**_):  # after the last cell: what the kernel keeps while its notebook stays open
        sampler.peak["kernel_after_kib"] = sum(memory_kib(pid)[1] for pid in process_tree(sampler.root))

    client.on_cell_start = on_cell_start
    client.on_cell_complete = on_cell_complete
    sampler.start()
    start = time.perf_counter()
    try:
        client.execute()
    finally:
        sampler.stop()
    cell = sampler.peak["pss_cell"]
    first_line = "".join(notebook.cells[cell].source).splitlines()[0] if cell is not None else ""
    return {**sampler.peak, "pss_cell_first_line": first_line, "seconds": time.perf_counter() - start}


def server_memory() -> dict | None:
    """PSS/RSS of an idle JupyterLab server on 127.0.0.1, or None if JupyterLab is not installed."""
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--IdentityProvider.token=", f"--ServerApp.root_dir={ROOT}"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                no_proxy.open(f"http://127.0.0.1:{port}/lab", timeout=5).read()  # the page and its extensions
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("JupyterLab did not answer within 120 s")
        time.sleep(1.0)
        rss, pss = (sum(values) for values in zip(*(memory_kib(p) for p in process_tree(server.pid))))
        return {"rss_kib": rss, "pss_kib": pss}
    finally:
        server.terminate()
        server.wait(30)


def _spread(values) -> str:
    return f"median {statistics.median(values) / MIB:6.0f} MiB  ({min(values) / MIB:.0f}..{max(values) / MIB:.0f})"


def report(results: dict) -> str:
    lines = [f"rounds: {results['rounds']}; {results['cpus']} CPUs; python {results['python']}; "
             f"torch {results['torch']}",
             "peak of the kernel and every process below it, summed over the processes:"]
    for name in results["notebooks"]:
        runs = results["runs"][name]
        cells = sorted({(r["pss_cell"], r["pss_cell_first_line"]) for r in runs}, key=lambda c: c[0] or 0)
        lines.append(f"  {name}: PSS {_spread([r['pss_kib'] for r in runs])}"
                     f"   RSS {_spread([r['rss_kib'] for r in runs])}"
                     f"   up to {max(r['processes'] for r in runs)} processes;"
                     f" PSS peak in cell(s) {[c[0] for c in cells]}: {[c[1][:60] for c in cells]}")
        heaviest = max(runs, key=lambda r: r["pss_kib"])
        parts = ", ".join(f"{what} {kib / MIB:.0f}" for what, kib in heaviest["pss_by_process"])
        lines.append(f"      its highest peak, PSS by process (MiB): {parts}")
    after = [r["kernel_after_kib"] for n in results["notebooks"] for r in results["runs"][n] if "kernel_after_kib" in r]
    if after:
        lines.append(f"  a kernel after its notebook ran (kept while the notebook stays open): PSS {_spread(after)}")
    servers = results["server"]
    if servers:
        lines.append(f"  JupyterLab server, idle: PSS {_spread([s['pss_kib'] for s in servers])}   "
                     f"RSS {_spread([s['rss_kib'] for s in servers])}")
    worst = max(statistics.median([r["pss_kib"] for r in results["runs"][n]]) for n in results["notebooks"])
    server = statistics.median([s["pss_kib"] for s in servers]) if servers else 0
    lines.append(f"=> what a Binder session must hold (server + the heaviest notebook, medians of PSS): "
                 f"{(worst + server) / MIB:.0f} MiB")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--notebooks", nargs="+", default=NOTEBOOKS)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "binder_memory",
                        help="writes OUT.json (every sample) and OUT.txt (the report)")
    args = parser.parse_args(argv)
    import torch

    results = {"rounds": args.rounds, "notebooks": args.notebooks, "cpus": os.cpu_count(),
               "python": platform.python_version(), "torch": torch.__version__,
               "runs": {name: [] for name in args.notebooks}, "server": [], "load_average": []}
    for round_ in range(args.rounds):
        for name in args.notebooks:  # interleaved: a slow moment of the machine hits every notebook alike
            run = notebook_peak(name)
            results["runs"][name].append(run)
            print(f"round {round_ + 1}: {name}: PSS {run['pss_kib'] / MIB:.0f} MiB, "
                  f"RSS {run['rss_kib'] / MIB:.0f} MiB, "
                  f"{run['processes']} processes, peak in cell {run['pss_cell']}, {run['seconds']:.0f} s", flush=True)
        server = server_memory()
        if server:
            results["server"].append(server)
            print(f"round {round_ + 1}: JupyterLab server: PSS {server['pss_kib'] / MIB:.0f} MiB", flush=True)
        results["load_average"].append(os.getloadavg()[0])
    text = report(results)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
