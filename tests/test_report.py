"""benchmarks/report.py: how the generated pages name the methods of a results file."""

from __future__ import annotations


def test_method_labels_name_the_selector_and_graphs_off():
    from benchmarks.report import _method_label

    def label(**args):
        return _method_label({"metadata": {"args": args}})

    assert label(quantkey_selector="quantkey")("quantkey-auto") == "quantkey-auto"
    assert label(quantkey_selector="quantkey[bits=4]")("quantkey") == "quantkey (quantkey[bits=4])"
    assert label(quantkey_selector="quantkey[bits=4]")("dynamic") == "dynamic"
    off = label(quantkey_selector="quantkey[bits=4]", cuda_graphs="off")
    assert off("quantkey") == "quantkey (quantkey[bits=4], cuda_graphs=False)"
    assert off("solohead") == "solohead (cuda_graphs=False)"
    assert off("quantkey-graphs") == "quantkey-graphs (quantkey[bits=4])"  # graphs forced on: no note
    assert label()("solohead") == "solohead"  # files from before either option
