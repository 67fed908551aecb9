"""ChestX-ray14 on fixture files in the NIH release's exact layout (Data_Entry_2017.csv, the official split
lists, images_*/images/*.png): labels, the patient-wise validation split, lazy decoding, ten-crop, and the
CheXNet preset's path end to end (DenseNet-121 with the ImageNet stem, FCL, plateau schedule)."""

import csv

import numpy as np
import pytest
import torch

from torchcal.experiments.config import load_config
from torchcal.experiments.data.chestxray import PATHOLOGIES, load_chestxray14
from torchcal.experiments.data.streaming import ImageFolderInputs
from torchcal.experiments.errors import DatasetError
from torchcal.experiments.models.registry import TenCrop

HEADER = ["Image Index", "Finding Labels", "Follow-up #", "Patient ID", "Patient Age", "Patient Gender",
          "View Position", "OriginalImage[Width", "Height]", "OriginalImagePixelSpacing[x", "y]", ""]  # fmt: skip
FINDINGS = ["No Finding", "Cardiomegaly|Effusion", "Atelectasis", "Effusion|Infiltration|Mass", "Hernia",
            "Pneumonia", "No Finding", "Edema|Consolidation", "Nodule", "Pneumothorax|Emphysema|Fibrosis",
            "Pleural_Thickening", "Infiltration"]  # fmt: skip


def write_chestxray(root, n_patients=12, per_patient=3, size=40, nested=True):
    """Patients 1..n with ``per_patient`` follow-ups each; the last quarter of patients in test_list.txt."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rows, train_val, test = [], [], []
    for pid in range(1, n_patients + 1):
        for f in range(per_patient):
            name = f"{pid:08d}_{f:03d}.png"
            finding = FINDINGS[(pid + f) % len(FINDINGS)]
            rows.append([name, finding, f, pid, 50, "M", "PA", 1024, 1024, 0.14, 0.14, ""])
            (test if pid > n_patients * 3 // 4 else train_val).append(name)
            folder = root / (f"images_{1 + pid % 2:03d}/images" if nested else "images")
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 255, (size, size), dtype=np.uint8)
            pixels[4 * ((pid + f) % 8) : 4 * ((pid + f) % 8) + 4] = 255  # a learnable trace of the finding
            Image.fromarray(pixels, mode="L").save(folder / name)
    with open(root / "Data_Entry_2017.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(HEADER)
        w.writerows(rows)
    (root / "train_val_list.txt").write_text("\n".join(train_val) + "\n")
    (root / "test_list.txt").write_text("\n".join(test) + "\n")


def test_reader_labels_split_and_lazy_images(tmp_path):
    write_chestxray(tmp_path)
    train, val, test = load_chestxray14(tmp_path, val_size=5, split_seed=1, image_size=24, eval_size=28)
    assert train.label_names == list(PATHOLOGIES) and train.targets.shape[1] == 14
    assert len(train) + len(val) == 27 and len(test) == 9
    patient = lambda p: p.name.split("_")[0]  # noqa: E731
    train_patients = {patient(p) for p in train.inputs.paths}
    val_patients = {patient(p) for p in val.inputs.paths}
    assert not train_patients & val_patients and len(val) >= 5  # whole patients, at least val_size images
    # labels: the row's findings in PATHOLOGIES order, "No Finding" all zeros
    names = [p.name for p in test.inputs.paths]
    for name, y in zip(names, test.targets):
        pid, f = int(name[:8]), int(name[9:12])
        finding = FINDINGS[(pid + f) % len(FINDINGS)]
        expected = set() if finding == "No Finding" else set(finding.split("|"))
        assert {PATHOLOGIES[j] for j in y.nonzero().squeeze(1).tolist()} == expected
    batch = test.inputs[torch.tensor([0, 2])]
    assert batch.shape == (2, 3, 28, 28) and batch.dtype == torch.uint8  # the runner scales it on the device
    assert torch.equal(batch[:, 0], batch[:, 1])  # a grayscale X-ray on three channels
    shard = test.inputs[1::2]
    assert isinstance(shard, ImageFolderInputs) and len(shard) == 4 and shard.shape == (4, 3, 28, 28)
    assert torch.equal(shard[0:1], test.inputs[1:2]) and train.inputs.head(3).shape[0] == 3


def test_reader_errors(tmp_path):
    with pytest.raises(DatasetError, match="Data_Entry_2017.csv.*images_\\*/images"):
        load_chestxray14(tmp_path)
    write_chestxray(tmp_path / "flat", nested=False)
    assert len(load_chestxray14(tmp_path / "flat", val_size=3)[2]) == 9  # one flat images/ folder works too
    (tmp_path / "flat" / "test_list.txt").unlink()
    with pytest.raises(DatasetError, match="test_list.txt"):
        load_chestxray14(tmp_path / "flat")
    write_chestxray(tmp_path / "bad")
    text = (tmp_path / "bad" / "Data_Entry_2017.csv").read_text().replace("Hernia", "Flu")
    (tmp_path / "bad" / "Data_Entry_2017.csv").write_text(text)
    with pytest.raises(DatasetError, match="unknown finding 'Flu'"):
        load_chestxray14(tmp_path / "bad")


def test_split_lists_that_repeat_or_share_images_are_refused(tmp_path):
    write_chestxray(tmp_path)  # patients 1-9 in train_val_list.txt, 10-12 in test_list.txt
    train_val = (tmp_path / "train_val_list.txt").read_text().split()
    test = (tmp_path / "test_list.txt").read_text().split()
    (tmp_path / "test_list.txt").write_text("\n".join(test + train_val[4:6]) + "\n")  # two leak into test
    shared = f"{tmp_path / 'train_val_list.txt'} and {tmp_path / 'test_list.txt'} share 2 image\\(s\\)"
    with pytest.raises(DatasetError, match=f"{shared}: {train_val[4]}, {train_val[5]}"):
        load_chestxray14(tmp_path, val_size=5, image_size=24)
    (tmp_path / "test_list.txt").write_text("\n".join(test) + "\n")
    (tmp_path / "train_val_list.txt").write_text("\n".join(train_val + [train_val[7]]) + "\n")
    with pytest.raises(
        DatasetError, match=f"train_val_list.txt lists 1 image\\(s\\) more than once: {train_val[7]}$"
    ):
        load_chestxray14(tmp_path, val_size=5, image_size=24)
    (tmp_path / "train_val_list.txt").write_text("\n".join(train_val) + "\n")
    (tmp_path / "test_list.txt").write_text("\n".join(test + test[:1]) + "\n")
    with pytest.raises(DatasetError, match=f"test_list.txt lists 1 image\\(s\\) more than once: {test[0]}$"):
        load_chestxray14(tmp_path, val_size=5, image_size=24)


def test_ten_crop_averages_the_ten_crops():
    class Corner(torch.nn.Module):  # logit = the crop's top-left pixel
        def forward(self, x):
            return x[:, 0, 0, :1].reshape(-1, 1) * torch.ones(1, 2)

    x = torch.arange(36, dtype=torch.float32).reshape(1, 1, 6, 6) / 36
    model = TenCrop(Corner(), crop=4, multilabel=True).eval()
    corners = [
        x[0, 0, 0, 0],
        x[0, 0, 0, 2],
        x[0, 0, 2, 0],
        x[0, 0, 2, 2],
        x[0, 0, 1, 1],  # crops
        x[0, 0, 0, 3],
        x[0, 0, 0, 5],
        x[0, 0, 2, 3],
        x[0, 0, 2, 5],
        x[0, 0, 1, 4],
    ]  # mirrored crops
    p = torch.sigmoid(torch.stack(corners)).mean()
    torch.testing.assert_close(model(x), torch.full((1, 2), float(torch.log(p / (1 - p)))))
    assert torch.equal(model.train()(x[..., :4, :4]), Corner()(x[..., :4, :4]))  # training: one crop


def test_chexnet_preset_path_end_to_end(tmp_path):
    from torchcal.experiments.evaluation.evaluate import evaluate_run, report
    from torchcal.experiments.training.loop import train

    write_chestxray(tmp_path / "data", n_patients=16)
    cfg = load_config("configs/chestxray14_densenet121_fcl.yaml", [
        f"data.root={tmp_path / 'data'}", "data.val_size=6", "data.image_size=32", "data.loader.batch_size=8",
        "data.loader.eval_batch_size=16", "train.epochs=2", "train.num_threads=1", "train.calibrators=[ts]"])  # fmt: skip
    assert cfg.data.ten_crop and cfg.model.name == "densenet121_imagenet" and cfg.optim.schedule == "plateau"
    with pytest.warns(UserWarning):
        rows = train(cfg, tmp_path / "run")
    assert len(rows) == 2 and all(np.isfinite(r["val_ece"]) for r in rows)
    logits = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    assert logits["test"]["logits"].shape == (12, 14) and logits["test"]["targets"].shape == (12, 14)
    res = evaluate_run(tmp_path / "run", ("ts",))
    assert len(res["uncalibrated"]["test"]["auroc_per_label"]) == 14
    markdown, _ = report([tmp_path / "run"], tmp_path / "rep", "ts")
    assert "AUROC Pleural_Thickening" in markdown and "AUROC Hernia" in markdown
    # the FCL paper's Fig. 1: Grad-CAM of the same X-rays under each model, from the command line
    from typer.testing import CliRunner

    from torchcal.experiments.cli import app

    runner = CliRunner()
    out = tmp_path / "gradcam.png"
    result = runner.invoke(app, ["gradcam", str(tmp_path / "run"), str(tmp_path / "run"), "--target", "Cardiomegaly",
                                 "--images", "0,1", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 5000
    result = runner.invoke(app, ["gradcam", str(tmp_path / "run"), "--target", "Flu", "--out", str(out)])
    assert result.exit_code == 2 and "--target must be a class index or one of the labels" in result.output


def test_grad_cam_of_a_linear_model_is_known():
    """Conv 1 × 1 → global average pool → linear: ∂y_c/∂A_k = W_ck/(h·w) at every position, so the map is
    ReLU(Σ_k W_ck A_k)/(h·w) (Zhou et al.'s CAM), hand-computed here."""
    from torchcal.experiments.reports.gradcam import default_layer, grad_cam

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 2))  # fmt: skip
    x = torch.randn(2, 3, 5, 6)
    assert default_layer(model, x) == "0"  # the pooled 1 × 1 output is not a map
    a = model[0](x).detach()
    for c in (0, 1):
        expected = torch.relu(torch.einsum("k,bkhw->bhw", model[3].weight[c].detach(), a)) / 30
        torch.testing.assert_close(grad_cam(model, x, c, normalize=False), expected)
        normalized = grad_cam(model, x, torch.tensor([c, c]))
        torch.testing.assert_close(normalized, expected / expected.flatten(1).amax(1)[:, None, None])
    with pytest.raises(ValueError, match="no layer with a 4-D"):
        grad_cam(torch.nn.Linear(3, 2), torch.randn(2, 3), 0)
