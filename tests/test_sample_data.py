"""The built-in real-text sample ships with the package and is well formed."""

import pytest

import packed_encoders.data as pe_data


def test_sample_shape_and_wrapping():
    s = pe_data.load_sample()
    assert s["license"].startswith("CC BY-SA 3.0") and s["attribution"]
    assert len(s["queries"]) == 64 and len(s["documents"]) == 24
    for item in s["queries"] + s["documents"]:
        ids = item["ids"]
        assert item["text"] and ids[0] == s["cls_id"] and ids[-1] == s["sep_id"]
        assert s["cls_id"] not in ids[1:-1] and s["sep_id"] not in ids[1:-1]
        assert all(0 <= t < 50368 for t in ids)
    q = sorted(len(x["ids"]) for x in s["queries"])
    d = sorted(len(x["ids"]) for x in s["documents"])
    assert q[-1] <= s["max_tokens"]["queries"] and d[-1] <= s["max_tokens"]["documents"]
    assert 400 <= (d[11] + d[12]) / 2 <= 800  # realistic document p50
    assert d[-1] > 1500 and d[0] < 100


def test_load_sample_returns_a_fresh_copy():
    a = pe_data.load_sample()
    a["queries"].clear()
    assert len(pe_data.load_sample()["queries"]) == 64


def test_demo_names_a_missing_checkpoint_folder(tmp_path, capsys):
    from packed_encoders import demo

    assert demo.main(["--model", str(tmp_path / "absent")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_calibrate_without_a_gpu_exits_with_a_message(capsys):
    import pytest
    import torch

    from packed_encoders import calibrate

    if torch.cuda.is_available():
        pytest.skip("measures on a GPU here")
    assert calibrate.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [(["--batch", "0"], "--batch must be at least 1"),
                                        (["--queries", "0"], "--queries must be at least 1"),
                                        (["--device", "nodevice"], "--device nodevice")])
def test_demo_refuses_bad_options_by_name(argv, match, capsys):
    from packed_encoders import demo

    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2 and match in capsys.readouterr().err


def test_demo_names_a_vocabulary_too_small_for_the_sample_ids(tmp_path, capsys):
    from transformers import ModernBertConfig, ModernBertModel

    from packed_encoders import demo

    cfg = ModernBertConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                           sep_token_id=2)
    ModernBertModel(cfg).save_pretrained(tmp_path)  # no tokenizer beside it: the sample's own ids
    assert demo.main(["--model", str(tmp_path), "--device", "cpu", "--documents", "1", "--queries", "2"]) == 2
    out = capsys.readouterr()
    assert "past its vocabulary (1000 entries)" in out.err and out.out.count("no tokenizer") == 1


def test_demo_names_a_checkpoint_that_is_no_modernbert(tmp_path, capsys):
    # Another architecture used to run its own stock forward on the sample first (a BERT crashed there with an
    # unrelated size error past its 512 positions); the demo now says what the folder holds, before running it.
    from transformers import BertConfig, BertModel

    from packed_encoders import demo

    BertModel(BertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16)).save_pretrained(tmp_path)
    assert demo.main(["--model", str(tmp_path), "--device", "cpu", "--documents", "1", "--queries", "2"]) == 2
    err = capsys.readouterr().err
    assert "not a ModernBERT checkpoint" in err and "BertModel" in err


def test_demo_names_a_folder_without_weights_and_a_refused_backend(tmp_path, capsys):
    # Both used to end in a traceback: from_pretrained's OSError, and pack()'s PackedEncodersError for a backend
    # this device cannot run (the other refusals of the demo exit 2 with one line).
    from transformers import ModernBertConfig, ModernBertModel

    from packed_encoders import demo

    cfg = ModernBertConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           vocab_size=50368, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                           sep_token_id=2)
    cfg.save_pretrained(tmp_path / "config_only")
    assert demo.main(["--model", str(tmp_path / "config_only"), "--device", "cpu"]) == 2
    assert "cannot load it" in capsys.readouterr().err
    ModernBertModel(cfg).save_pretrained(tmp_path / "model")
    argv = ["--model", str(tmp_path / "model"), "--device", "cpu", "--documents", "1", "--queries", "2"]
    assert demo.main(argv + ["--attention-backend", "nonesuch"]) == 2
    assert "pe.pack refused: attention_backend='nonesuch'" in capsys.readouterr().err


def test_calibrate_from_a_file_that_is_no_sweep_exits_with_a_message(tmp_path, capsys):
    from packed_encoders import calibrate

    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "text.json").write_text("not json")
    for name in ("missing.json", "list.json", "text.json"):
        assert calibrate.main(["--from-sweep", str(tmp_path / name), "--out", str(tmp_path / "p.json")]) == 2
        assert f"--from-sweep {tmp_path / name}: " in capsys.readouterr().err


def test_demo_pads_with_an_id_of_the_vocabulary_when_the_config_names_none(tmp_path, capsys):
    """A checkpoint whose config has no ``pad_token_id`` used to be padded with ModernBERT's [PAD] id (50283),
    past a smaller vocabulary: stock's embedding raised ``IndexError`` (exit 1, the parity failure's code). Padding
    is masked, so any id of the vocabulary serves."""
    from packed_encoders import demo
    from tests.tiny_tokenizer import save_tiny_model

    path = save_tiny_model(tmp_path / "model", pad_token_id=None)
    assert demo.main(["--model", path, "--device", "cpu", "--documents", "1", "--queries", "4"]) == 0
    out = capsys.readouterr().out
    assert "parity: ok" in out and "attention used (last call): {" in out
