"""The metrics of a run drawn as a PNG, from the Result and from `jaxtrain show --plot`; the
files are read back as images."""

from __future__ import annotations

import pytest

from jaxtrain import JaxTrainer, Result, RunConfig, cli

matplotlib = pytest.importorskip("matplotlib")


def _train():
    from jaxtrain import report

    for step in range(6):
        report({"step": step, "loss": 2.0 ** -step, "eval": {"acc": step / 5}, "tag": "x"})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    storage = tmp_path_factory.mktemp("runs")
    return JaxTrainer(_train, run_config=RunConfig(name="plotted", storage_path=str(storage))
                      ).fit().path


def _image(path):
    from matplotlib import image

    return image.imread(path)  # a PNG that does not decode raises here


def test_result_plot_draws_every_numeric_metric(run_dir, tmp_path):
    result = Result.from_path(run_dir)
    path = result.plot()
    assert path == f"{run_dir}/metrics.png"
    height, width, _ = _image(path).shape
    assert (width, height) == (1200, 640)  # 2 x 2 panels: step, loss, eval/acc (+1 hidden)
    one = result.plot(tmp_path / "loss.png", metrics=["loss"])
    assert _image(one).shape[:2] == (320, 600)
    with pytest.raises(ValueError, match=r"'tag' is not a numeric metric.*'eval/acc'"):
        result.plot(tmp_path / "x.png", metrics=["tag"])


def test_show_plot_writes_the_png_and_says_where(run_dir, tmp_path, capsys):
    assert cli.main(["show", run_dir, "--plot", str(tmp_path / "curve.png")]) == 0
    out = capsys.readouterr().out
    assert f"plot       {tmp_path / 'curve.png'}" in out
    assert _image(tmp_path / "curve.png").shape[:2] == (640, 1200)
