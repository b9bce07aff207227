"""course_lib.bench: the bandwidth formulas, the records, a tiny real run and the command line."""

import json
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from course_lib import allreduce, bench


def test_algbw_and_busbw_follow_nccl_tests():
    # algbw = S / t in GB/s (1e9 bytes per second); all-reduce busbw = algbw * 2(G-1)/G.
    assert bench.algbw(2e9, 4.0) == 0.5
    assert bench.algbw(2**30, 1.0) == pytest.approx(1.073741824)
    for g in (2, 3, 4, 8, 1024):
        assert bench.busbw(1.0, g) == pytest.approx(2 * (g - 1) / g)
        assert bench.busbw(1.0, g, "all_gather") == bench.busbw(1.0, g, "reduce_scatter") == pytest.approx((g - 1) / g)
        assert bench.busbw(1.0, g, "broadcast") == bench.busbw(1.0, g, "reduce") == 1.0
    assert bench.busbw(3.0, 2) == 3.0  # on 2 ranks every byte crosses the link once each way
    with pytest.raises(ValueError, match="no busbw factor"):
        bench.busbw(1.0, 4, "gossip")


def test_sizes_are_read_and_written_in_binary_units():
    assert bench.parse_bytes("16MiB") == bench.parse_bytes("16M") == 16 * 2**20
    assert bench.parse_bytes("1KB") == 1000 and bench.parse_bytes(" 4 KiB ") == 4096
    assert bench.parse_bytes(4096) == bench.parse_bytes("4096") == 4096
    for bad in ("16 parsecs", "-3", "0", "1.5"):
        with pytest.raises(ValueError):
            bench.parse_bytes(bad)
    assert [bench.format_bytes(n) for n in (512, 4096, 3 * 2**19, 64 * 2**20, 2**30)] == \
        ["512 B", "4 KiB", "1.5 MiB", "64 MiB", "1 GiB"]
    # three significant digits without an exponent, also between 1000 and 1023 of a unit (a crossover printed as '1e+03 KiB')
    assert [bench.format_bytes(n) for n in (5000, 1000 * 1024 + 300, 1023 * 1024 + 5)] == ["4.88 KiB", "1000 KiB", "1023 KiB"]


def test_result_statistics_and_bandwidths():
    times = [0.5, 0.1, 0.3, 0.2, 0.4]
    r = bench.Result("ring", 4, 2**20, 2**18, "float32", "gloo", times=times)
    assert (r.median, r.min, r.max) == (0.3, 0.1, 0.5)
    assert r.quartiles == pytest.approx(tuple(np.percentile(times, [25, 75])))
    assert r.algbw == pytest.approx(2**20 / 0.3 / 1e9)
    assert r.busbw == pytest.approx(r.algbw * 1.5)
    record = r.to_dict()
    assert record["busbw_GBps"] == r.busbw and record["times"] == times
    assert bench.Result.from_dict(json.loads(json.dumps(record))) == r


def _check_records(results, sizes, world_size, variants, reps):
    assert [(r.world_size, r.nbytes, r.variant) for r in results] == \
        [(world_size, n, v) for n in sizes for v in variants]
    for r in results:
        assert r.correct, r
        assert len(r.times) == reps and all(0 < t < 10 for t in r.times)
        assert r.numel * 4 == r.nbytes and r.dtype == "float32" and r.backend == "gloo"
        assert r.min <= r.median <= r.max
        assert r.busbw == pytest.approx(r.nbytes / r.median / 1e9 * 2 * (world_size - 1) / world_size)


def test_a_tiny_real_run_returns_sane_records():
    sizes = [1024, 256 * 1024 + 12]  # the second is not divisible by the world size in elements
    results = bench.run(sizes, world_sizes=[2], reps=2, warmup=1, backend="gloo")
    _check_records(results, sizes, 2, bench.VARIANTS, reps=2)
    # How the times compare across sizes is a measurement (benchmarks/allreduce_figures.py,
    # notebook 10), not something a unit test on a shared 2-core machine can assert reliably.
    table = results.table()
    assert table.count("\n") == 1 + len(results) and "busbw GB/s" in table


def test_a_wrong_variant_is_reported(monkeypatch):
    # A "variant" that does nothing must be caught by the comparison with the built-in all_reduce.
    monkeypatch.setitem(allreduce.VARIANTS, "lazy", lambda tensor, op="SUM": None)
    results = bench.run([4096], world_sizes=[3], variants=["lazy", "ring"], reps=1, warmup=0, backend="gloo")
    assert [r.correct for r in results] == [False, True]


def test_the_time_of_a_repetition_is_the_slowest_ranks(monkeypatch):
    # Rank r sleeps 0.1 r seconds: every kept time must be at least rank 2's 0.2 s, not rank 0's 0.
    import torch.distributed as dist

    def uneven(tensor, op="SUM"):
        time.sleep(0.1 * dist.get_rank())
        dist.all_reduce(tensor)

    monkeypatch.setitem(allreduce.VARIANTS, "uneven", uneven)
    results = bench.run([64], world_sizes=[3], variants=["uneven"], reps=2, warmup=0, backend="gloo")
    assert all(t >= 0.2 for t in results[0].times), results[0].times


def test_bad_arguments_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        bench.run([1024], world_sizes=[1])
    with pytest.raises(ValueError, match="unknown variant"):
        bench.run([1024], world_sizes=[2], variants=["ring", "telepathy"])
    with pytest.raises(ValueError, match="unknown variant"):
        bench.run([1024], world_sizes=[2], variants=[])
    with pytest.raises(ValueError, match="reps"):
        bench.run([1024], world_sizes=[2], reps=0)


def test_spread_and_paired_ratios():
    assert bench.spread([3.0, 1.0, 2.0, 5.0, 4.0]) == dict(median=3.0, q1=2.0, q3=4.0, min=1.0, max=5.0, n=5)
    assert bench.spread([7.0]) == dict(median=7.0, q1=7.0, q3=7.0, min=7.0, max=7.0, n=1)
    with pytest.raises(ValueError):
        bench.spread([])
    # Paired: repetition by repetition, so a slow repetition slows both and the ratio stays put.
    ref = bench.Result("builtin", 4, 1024, 256, "float32", "gloo", times=[1.0, 2.0, 10.0])
    fast = bench.Result("tree", 4, 1024, 256, "float32", "gloo", times=[0.5, 1.0, 5.0])
    results = bench.Results([fast, ref])
    assert results.ratios("tree", "builtin", 4, 1024) == [0.5, 0.5, 0.5] == fast.ratios(ref)
    assert fast.median / ref.median == 0.5
    other_size = bench.Result("builtin", 4, 2048, 512, "float32", "gloo", times=[1.0, 2.0, 10.0])
    with pytest.raises(ValueError, match="same repetitions"):
        fast.ratios(other_size)
    table = results.table("builtin")
    assert "x builtin" in table and "0.500 (0.50..0.50)" in table
    markdown = results.to_markdown("builtin", meta={"loadavg_before": [0.5, 0.4, 0.3], "note": "a test"})
    assert "| tree | 1.00 s | 750.00 ms..3.00 s | 500.00 ms..5.00 s |" in markdown and "0.500 (0.50..0.50; 0.50..0.50)" in markdown
    assert "Load average (1, 5, 15 min): [0.5, 0.4, 0.3]" in markdown and "Note: a test" in markdown


def test_machine_description_says_what_a_reader_needs():
    info = bench.machine_description()
    assert info["cpus"] >= 1 and info["torch"] and info["python"] and info["date"]
    assert info["cpus_usable"] >= 1 and isinstance(info["cpu_model"], str)
    assert info["loadavg"] is None or len(info["loadavg"]) == 3


def test_every_variant_by_name_and_a_new_order_every_repetition(monkeypatch):
    # 'all' is every registered variant and the built-in; each call is logged by the rank that makes
    # it, so the order within each repetition can be read back: it must be bench.run_order's, the
    # same on both ranks, and over the repetitions no variant always follows the same neighbour.
    import torch.distributed as dist

    assert bench._check_variants(["all"]) == bench.ALL_VARIANTS
    assert set(bench.ALL_VARIANTS) - {"builtin"} == set(allreduce.VARIANTS) - {"master"}
    with pytest.raises(ValueError, match="twice"):
        bench._check_variants(["ring", "ring"])
    calls = []

    def logged(name):
        def fn(tensor, op="SUM"):
            calls.append(name)
            dist.all_reduce(tensor)
        return fn

    for name in "abc":
        monkeypatch.setitem(allreduce.VARIANTS, name, logged(name))

    def rank_fn(rank, world_size):
        bench.measure_in_rank(64, ("a", "b", "c"), reps=4, warmup=1)
        return calls

    import course_lib

    orders = course_lib.launch(rank_fn, 2, backend="gloo")
    assert orders[0] == orders[1]
    rounds = [orders[0][i:i + 3] for i in range(0, 15, 3)]
    assert rounds == [["abc"[i] for i in bench.run_order(3, rep)] for rep in range(5)]
    assert all(sorted(r) == list("abc") for r in rounds)
    # Over 30 repetitions every variant runs first, and after each of the others.
    orders_30 = [bench.run_order(3, rep) for rep in range(30)]
    assert {o[0] for o in orders_30} == {0, 1, 2}
    assert {(o[i], o[i + 1]) for o in orders_30 for i in range(2)} == {(a, b) for a in range(3) for b in range(3) if a != b}


def test_one_launch_for_all_sizes_and_saved_results(tmp_path):
    results = bench.run([1024, 4096], world_sizes=[3], variants=["ring", "tree", "builtin"], reps=2, warmup=0,
                        backend="gloo", one_launch=True)
    _check_records(results, [1024, 4096], 3, ("ring", "tree", "builtin"), reps=2)
    json_path, md_path = results.save(tmp_path / "sub" / "out", "builtin", meta={"note": "unit test"})
    document = json.loads(open(json_path).read())
    assert document["meta"]["reference"] == "builtin" and document["meta"]["cpus"] >= 1
    for record in document["results"]:
        if record["variant"] == "builtin":
            assert "paired_ratios" not in record
        else:
            ref = next(r for r in document["results"] if r["variant"] == "builtin" and r["nbytes"] == record["nbytes"])
            assert record["paired_ratios"] == [t / b for t, b in zip(record["times"], ref["times"])]
            assert record["paired_ratio"]["median"] == statistics.median(record["paired_ratios"])
    text = open(md_path).read()
    assert text.count("## 3 ranks") == 2 and "| tree |" in text and "Note: unit test" in text


def test_cli_writes_valid_json_and_a_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = subprocess.run(
        [sys.executable, "-m", "course_lib.bench", "--sizes", "1KiB,64KiB", "--world-sizes", "2",
         "--variants", "ring,builtin", "--reps", "2", "--backend", "gloo", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert document["meta"]["torch"] and document["units"]["busbw_GBps"] == "1e9 bytes/s"
    records = document["results"]
    assert [(r["nbytes"], r["variant"]) for r in records] == [(1024, "ring"), (1024, "builtin"),
                                                                (65536, "ring"), (65536, "builtin")]
    for r in records:
        assert r["median_s"] == statistics.median(r["times"]) and r["correct"] is True
        assert r["busbw_GBps"] == pytest.approx(r["nbytes"] / r["median_s"] / 1e9)  # G=2: factor 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[2/2," in done.stderr  # progress lines
    assert "ring" in done.stdout and "busbw" in done.stdout
    assert len(bench.Results.from_json(out)) == 4


def test_cli_saves_markdown_and_json_with_paired_ratios(tmp_path):
    stem = tmp_path / "bench_3ranks"
    done = subprocess.run(
        [sys.executable, "-m", "course_lib.bench", "--sizes", "4KiB", "--world-sizes", "3", "--variants",
         "ring,halving_doubling,builtin", "--reference", "ring", "--reps", "2", "--backend", "gloo",
         "--save", str(stem), "--quiet"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "x ring (IQR)" in done.stdout
    document = json.loads((tmp_path / "bench_3ranks.json").read_text())
    assert document["meta"]["reference"] == "ring" and document["meta"]["reps"] == 2
    assert len(document["meta"]["loadavg_before"]) == 3
    assert [r["variant"] for r in document["results"]] == ["ring", "halving_doubling", "builtin"]
    assert "paired_ratios" in document["results"][1] and "paired_ratios" not in document["results"][0]
    assert "x ring, paired" in (tmp_path / "bench_3ranks.md").read_text()
    refused = subprocess.run([sys.executable, "-m", "course_lib.bench", "--variants", "ring", "--reference", "tree"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "not among the variants" in refused.stderr


def test_cpu_accounting_tells_work_from_waiting(monkeypatch, tmp_path):
    # Two stand-in variants take about the same time: one spins the CPU for 40 ms on every rank, the
    # other sleeps 40 ms. CPU time summed over the ranks must tell them apart: the spinner costs at
    # least 2 ranks x 40 ms, the sleeper a small fraction of that. The idle share is a share.
    import torch.distributed as dist

    import course_lib

    def spin(tensor, op="SUM"):
        end = time.process_time() + 0.04
        while time.process_time() < end:
            pass
        dist.all_reduce(tensor)

    def sleep(tensor, op="SUM"):
        time.sleep(0.04)
        dist.all_reduce(tensor)

    monkeypatch.setitem(allreduce.VARIANTS, "spin", spin)
    monkeypatch.setitem(allreduce.VARIANTS, "sleep", sleep)

    def rank_fn(rank, world_size):
        return bench.measure_in_rank(4096, ("spin", "sleep", "builtin"), reps=3, warmup=1, cpu=True)

    results = bench.Results(bench.Result(**r) for r in course_lib.launch(rank_fn, 2, backend="gloo")[0])
    spinner, sleeper = results.get("spin", 2, 4096), results.get("sleep", 2, 4096)
    assert len(spinner.cpu_seconds) == len(spinner.idle_ticks) == len(spinner.total_ticks) == 3
    assert all(c >= 2 * 0.04 * 0.95 for c in spinner.cpu_seconds), spinner.cpu_seconds
    assert sleeper.cpu_median < spinner.cpu_median / 4, (sleeper.cpu_seconds, spinner.cpu_seconds)
    for r in results:
        assert r.idle_share is None or 0.0 <= r.idle_share <= 1.0
    # The CPU figures survive a round trip through JSON and appear in both reports.
    json_path, md_path = results.save(tmp_path / "cpu", "builtin")
    again = bench.Results.from_json(json_path)
    assert [r.cpu_seconds for r in again] == [r.cpu_seconds for r in results]
    assert [r.idle_ticks for r in again] == [r.idle_ticks for r in results]
    assert "machine idle" in open(md_path).read() and "CPU/call" in results.table("builtin")
    # Measured without cpu=True: no CPU columns, and older files without the fields still load.
    plain = bench.Result(variant="ring", world_size=2, nbytes=64, numel=16, dtype="float32", backend="gloo",
                         times=[0.1])
    assert plain.cpu_median is None and plain.idle_share is None
    assert "CPU/call" not in bench.Results([plain]).table()
    old_record = {k: v for k, v in plain.to_dict().items() if k not in ("cpu_seconds", "idle_ticks", "total_ticks")}
    assert bench.Result.from_dict(old_record) == plain


def test_launches_pool_into_pairs_that_stay_pairs(monkeypatch):
    # benchmarks/large_allreduce_work.py pools launches by concatenating each variant's repetitions in
    # launch order: the k-th time of one variant must still pair with the k-th time of the built-in.
    import importlib
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    work = importlib.import_module("large_allreduce_work")

    def launch(ring_times, builtin_times, cpu):
        common = dict(world_size=4, nbytes=64, numel=16, dtype="float32", backend="gloo")
        return bench.Results([
            bench.Result(variant="ring", times=ring_times, cpu_seconds=[cpu] * len(ring_times),
                         idle_ticks=[1] * len(ring_times), total_ticks=[4] * len(ring_times), **common),
            bench.Result(variant="builtin", times=builtin_times, cpu_seconds=[2 * cpu] * len(builtin_times),
                         idle_ticks=[0] * len(builtin_times), total_ticks=[4] * len(builtin_times), **common)])

    launches = [launch([1.0, 2.0], [2.0, 2.0], 0.1), launch([3.0, 6.0, 9.0], [1.0, 2.0, 3.0], 0.3)]
    pooled = work.pool(launches)
    assert pooled.ratios("ring", "builtin", 4, 64) == [0.5, 1.0, 3.0, 3.0, 3.0]
    ring = pooled.get("ring", 4, 64)
    assert ring.cpu_seconds == [0.1, 0.1, 0.3, 0.3, 0.3] and ring.idle_share == 0.25
    medians = work.launch_medians(launches)
    assert medians == [dict(variant="ring", world_size=4, nbytes=64, medians=[0.75, 3.0])]
