"""The report's paired comparison against dense: pairing, bootstrap intervals, counts and the rendered section."""

from __future__ import annotations

import json
import random

import pytest

from eval_harness.report import pair_scores, paired_bootstrap, render


def records(method, scores, task="vt", length=4096):
    return [{"method": method, "task": task, "length": length, "sample_id": f"0-{i}", "score": s}
            for i, s in enumerate(scores)]  # fmt: skip


def key(r):
    return (r["task"], r["length"]), r["sample_id"]


def test_known_difference_is_covered():
    rng = random.Random(1)
    dense = [rng.choice([0.0, 100.0]) for _ in range(400)]
    other = [d if rng.random() < 0.8 else 0.0 for d in dense]  # loses a fifth of dense's hits
    true = sum(dense) / 400 - sum(other) / 400
    per_cell, average = paired_bootstrap(pair_scores(records("dense", dense), records("m", other), key))
    d = per_cell[("vt", 4096)]
    assert d.mean == pytest.approx(true) and d.low < true < d.high and d.high - d.low < 10
    assert (d.dense_higher, d.method_higher, d.equal) == (sum(a > b for a, b in zip(dense, other)), 0,
                                                          sum(a == b for a, b in zip(dense, other)))  # fmt: skip
    assert average([("vt", 4096)]) == d
    again, _ = paired_bootstrap(pair_scores(records("dense", dense), records("m", other), key))
    assert again == per_cell  # fixed seed: the same interval every time


def test_identical_methods_give_zero():
    scores = [0.0, 100.0, 50.0, 100.0] * 10
    cells = pair_scores(records("dense", scores) + records("dense", scores, task="cwe"),
                        records("m", scores) + records("m", scores, task="cwe"), key)  # fmt: skip
    per_cell, average = paired_bootstrap(cells, resamples=500)
    for d in [*per_cell.values(), average(list(cells))]:
        assert (d.mean, d.low, d.high) == (0.0, 0.0, 0.0)
        assert d.dense_higher == d.method_higher == 0 and d.equal == 40 * d.cells
    assert average(list(cells)).cells == 2


def test_stratified_average_of_two_tasks():
    cells = pair_scores(records("dense", [100.0] * 20) + records("dense", [100.0] * 20, task="cwe"),
                        records("m", [0.0] * 20) + records("m", [100.0] * 20, task="cwe"), key)  # fmt: skip
    _, average = paired_bootstrap(cells, resamples=500)
    d = average(list(cells))
    assert (d.mean, d.low, d.high) == (50.0, 50.0, 50.0)  # no spread within either task
    assert (d.dense_higher, d.method_higher, d.equal) == (20, 0, 20)


def test_mismatched_samples_are_refused():
    dense = records("dense", [100.0] * 5)
    with pytest.raises(ValueError, match=r"different samples for dense and m: 1 only in dense \(0-4\), 0 only"):
        pair_scores(dense, records("m", [100.0] * 4), key)
    with pytest.raises(ValueError, match="appears twice"):
        pair_scores(dense, records("m", [100.0] * 5) + records("m", [0.0]), key)
    assert pair_scores(dense, records("m", [100.0] * 5, length=8192), key) == {}  # no shared cell: nothing paired


def write_study(tmp_path, headers_and_records):
    folder = tmp_path / "s"
    folder.mkdir(parents=True)
    for n, (header, recs) in enumerate(headers_and_records):
        lines = [{"type": "header", **header}] + [{"type": "result", "suite": "ruler", "budget": None if r["method"]
                 == "dense" else "1/16", "time_s": 1.0, **r} for r in recs]  # fmt: skip
        (folder / f"s-{n}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_rendered_section_pairs_by_prompt_and_names_differing_runs(tmp_path):
    dense = [{**r, "prompt_sha256": f"h{i}"} for i, r in enumerate(records("dense", [100.0, 0.0, 100.0]))]
    other = [{**r, "prompt_sha256": f"h{i}", "estimate_kernel": ["mma"]}
             for i, r in enumerate(records("m", [0.0, 0.0, 100.0]))]  # fmt: skip
    write_study(tmp_path, [({"git_commit": "aaaa", "generation": {"batch_size": 50}}, dense),
                           ({"git_commit": "bbbb", "generation": {"batch_size": 25}}, other)])  # fmt: skip
    md = render("s", tmp_path).split("## Paired difference against dense")[1]
    assert "pair by their prompt's sha256" in md
    assert "`m 1/16` ran at commit bbbb (dense: aaaa); batch size 25 (dense: 50)." in md
    assert "`m 1/16` mma" in md
    assert "| m 1/16 | vt | 33.3 [" in md and "] 1/0/2 |" in md


def test_runs_pair_by_source_hash_where_every_header_has_one(tmp_path):
    dense = [{**r, "prompt_sha256": f"h{i}"} for i, r in enumerate(records("dense", [100.0, 0.0]))]
    other = [{**r, "prompt_sha256": f"h{i}"} for i, r in enumerate(records("m", [100.0, 0.0]))]
    same = {"source_sha256": "c0de" * 16, "generation": {"batch_size": 25}}
    # The same sources run from a copy without its git directory: one code version, whatever the commits say.
    write_study(tmp_path, [({"git_commit": "aaaa", **same}, dense), ({"git_commit": None, **same}, other)])
    md = render("s", tmp_path).split("## Paired difference against dense")[1]
    assert "Every method ran with the code and batch size of dense (source sha256 c0dec0dec0; commits aaaa;" in md
    # Other sources at the same commit (uncommitted edits): named as a difference.
    write_study(tmp_path / "b", [({"git_commit": "aaaa", **same}, dense),
                                 ({"git_commit": "aaaa", **same, "source_sha256": "beef" * 16}, other)])  # fmt: skip
    md = render("s", tmp_path / "b").split("## Paired difference against dense")[1]
    assert "Runs that differ from dense in code (source sha256) or batch size" in md
    assert "`m 1/16` ran at code beefbeefbe (dense: c0dec0dec0), commit aaaa (dense: aaaa)." in md
    # A file without a source hash: commits decide, as before.
    write_study(tmp_path / "c", [({"git_commit": "aaaa", **same}, dense), ({"git_commit": "bbbb"}, other)])
    md = render("s", tmp_path / "c").split("## Paired difference against dense")[1]
    assert "`m 1/16` ran at commit bbbb (dense: aaaa); batch size None (dense: 25)." in md


def test_answers_that_part_at_the_first_token_are_counted(tmp_path):
    def rec(method, i, score, first, prediction):
        return {"task": "vt", "length": 8, "method": method, "sample_id": i, "prompt_sha256": f"h{i}", "score": score,
                "first_token": first, "prediction": prediction}  # fmt: skip

    dense = [rec("dense", 0, 100.0, 5, "a b"), rec("dense", 1, 100.0, 5, "a b"), rec("dense", 2, 0.0, 5, "a c"),
             rec("dense", 3, 100.0, 5, "a b")]  # fmt: skip
    # sample 0 the same; 1 parts at the first token and loses; 2 parts later and gains; 3 parts at the first token
    # with the same score
    other = [rec("m", 0, 100.0, 5, "a b"), rec("m", 1, 0.0, 7, "x"), rec("m", 2, 100.0, 5, "a b"),
             rec("m", 3, 100.0, 6, "z b")]  # fmt: skip
    write_study(tmp_path, [({"git_commit": "aaaa"}, dense + other)])
    md = render("s", tmp_path).split("## Paired difference against dense")[1]
    assert "| m 1/16 | 4 | 3 | 2 | 2 | 1 (1 lower / 0 higher) |" in md
    write_study(tmp_path / "old", [({"git_commit": "aaaa"}, [{k: v for k, v in r.items() if k != "first_token"}
                                                             for r in dense + other])])  # fmt: skip
    assert "from the first token" not in render("s", tmp_path / "old")


def test_no_dense_no_comparison(tmp_path):
    write_study(tmp_path, [({"git_commit": "aaaa"}, records("m", [100.0]))])
    assert "This study has no dense results" in render("s", tmp_path)


def test_certificate_fit_ranks_losses_by_the_missed_mass():
    from eval_harness.report import certificate_fit

    rng = random.Random(3)
    certificates = [rng.random() for _ in range(80)]
    losses = [100.0 if c > 0.7 and rng.random() < 0.8 else 0.0 for c in certificates]  # losses where much is missed
    fit = certificate_fit(certificates, losses)
    assert fit.samples == 80 and fit.low < fit.spearman < fit.high and fit.low > 0.3
    assert [q[0] for q in fit.quartiles] == [20] * 4
    assert fit.quartiles[0][2] == 0.0 and fit.quartiles[-1][2] > 50 and fit.quartiles[-1][3] > 0.5
    assert fit.quartiles[0][1] < fit.quartiles[-1][1]
    unrelated = certificate_fit(certificates, [rng.choice([0.0, 100.0]) for _ in certificates])
    assert unrelated.low < 0 < unrelated.high  # no relation: the interval covers zero
    assert certificate_fit([0.1] * 5, [0.0] * 5).spearman is None  # constant: no correlation, no interval
    assert certificate_fit(certificates, losses) == fit  # fixed seed
    with pytest.raises(ValueError, match="certificates for"):
        certificate_fit([0.1, 0.2], [0.0])


def test_rendered_certificate_section_only_where_records_carry_it(tmp_path):
    rng = random.Random(4)
    dense_scores = [100.0] * 40
    missed = [rng.random() * 0.3 for _ in range(40)]
    method_scores = [0.0 if m > 0.2 else 100.0 for m in missed]
    dense = records("dense", dense_scores)
    other = [{**r, "missed_mass": {"mean": m, "max": m, "steps": 5}} for r, m in zip(records("m", method_scores), missed)]
    write_study(tmp_path, [({"git_commit": "aaaa"}, dense + other)])
    text = render("s", tmp_path)
    assert "## The accuracy certificate against the score lost" in text
    rows = [line for line in text.splitlines() if line.startswith("| m 1/16 |") and "Spearman" not in line]
    cert = [line for line in rows if line.count("/") >= 8]
    assert len(cert) == 2 and "| 40 |" in cert[0] and "| all |" in cert[1]  # the length and all
    spearman = float(cert[1].split("|")[4].split()[0])
    assert spearman > 0.7
    batch = "of its `generate()` call: the batch's, shared by the samples of one call (batch sizes 1)"
    assert f"(`missed_mass[\"mean\"]` {batch})" in text  # records without per_sequence: the call's
    own = [{**r, "missed_mass": {**r["missed_mass"], "per_sequence": True}, "batch": 20} for r in other]
    write_study(tmp_path / "own", [({"git_commit": "aaaa"}, dense + own)])
    assert "(`missed_mass[\"mean\"]` of the sample's own sequence)" in render("s", tmp_path / "own")
    (tmp_path / "plain").mkdir()
    write_study(tmp_path / "plain", [({"git_commit": "aaaa"}, dense + records("m", method_scores))])
    assert "accuracy certificate" not in render("s", tmp_path / "plain")
