"""SentenceTransformer (mean pooling) and sentence-transformers v6 multi-vector models, packed vs stock."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import packed_encoders as pe
from tests.tiny_tokenizer import TEXTS, save_tiny_model

st = pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_modernbert"))


def _forget_validation_call(model):
    """Clear the attention plan pack()'s validation call left, so that describe()'s ``last_attention`` shows
    whether the calls after it ran packed."""
    from packed_encoders.adapters.locate import find_encoders
    from packed_encoders.adapters.state import get_state

    for _, encoder in find_encoders(model):
        get_state(encoder).last_plan = {}


def test_sentence_transformer_encode_parity(model_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(model_dir)
    model = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                                device="cpu")
    ref = model.encode(TEXTS, batch_size=3, convert_to_tensor=True)
    pe.pack(model)
    assert pe.describe(model)["encoders"][0]["packed"]
    _forget_validation_call(model)
    out = model.encode(TEXTS, batch_size=3, convert_to_tensor=True)
    assert pe.describe(model)["encoders"][0]["last_attention"]  # the packed path really ran
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert cos.min() > 0.99999
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    pe.unpack(model)
    np.testing.assert_allclose(model.encode(TEXTS[:2]), ref[:2].numpy(), atol=1e-6)


def test_multi_vector_encoder_parity(model_dir):
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.base.modules.dense import Dense

    transformer = Transformer(model_dir)
    dense = Dense(transformer.get_embedding_dimension(), 32, bias=False, activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings", module_output_name="token_embeddings")
    model = MultiVectorEncoder(modules=[transformer, dense], device="cpu")
    ref = model.encode_document(TEXTS, batch_size=4)
    pe.pack(model)
    _forget_validation_call(model)
    out = model.encode_document(TEXTS, batch_size=4)
    assert pe.describe(model)["encoders"][0]["last_attention"]
    assert len(out) == len(ref)
    for a, b in zip(out, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-4)


def test_multi_vector_query_expansion_parity(model_dir):
    """Masked query expansion: expansion positions keep attention_mask 0 but their outputs are scored."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    transformer = Transformer(model_dir)
    transformer.query_expansion = {"strategy": "fixed", "length": 12, "attend": False}
    dense = Dense(transformer.get_embedding_dimension(), 16, bias=False, activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings", module_output_name="token_embeddings")
    model = MultiVectorEncoder(modules=[transformer, dense, MultiVectorMask()], device="cpu")
    queries = TEXTS[:5]
    ref = model.encode_query(queries, batch_size=5)
    pe.pack(model)
    assert "12 wide" in pe.describe(model)["encoders"][0]["padded_outputs"]
    out = model.encode_query(queries, batch_size=5)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and a.shape[0] == 12
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-4)


def test_query_expansion_changed_after_pack_is_honoured(model_dir):
    """padded_outputs="auto" follows the target's query expansion as it is at each call: switched on after pack(),
    widened, switched off, and on a deep copy of the packed target."""
    import copy

    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    transformer = Transformer(model_dir)
    dense = Dense(transformer.get_embedding_dimension(), 16, bias=False, activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings", module_output_name="token_embeddings")
    ref = MultiVectorEncoder(modules=[transformer, dense, MultiVectorMask()], device="cpu")
    model = copy.deepcopy(ref)
    pe.pack(model)  # packed with expansion off
    assert pe.describe(model)["encoders"][0]["padded_outputs"] == "zeros"
    queries = TEXTS[:5]

    def same(a_model, b_model, width):
        for a, b in zip(a_model.encode_query(queries, batch_size=5), b_model.encode_query(queries, batch_size=5)):
            assert a.shape == b.shape and (width is None or a.shape[0] == width)
            torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-4)

    for setting, width in (({"strategy": "fixed", "length": 12, "attend": False}, 12),
                           ({"strategy": "fixed", "length": 32, "attend": False}, 32), (None, None)):
        for m in (ref, model):
            m[0].query_expansion = setting
        same(ref, model, width)
    twin = copy.deepcopy(model)
    for m in (ref, twin):
        m[0].query_expansion = {"strategy": "fixed", "length": 12, "attend": False}
    assert "12 wide" in pe.describe(twin)["encoders"][0]["padded_outputs"]
    assert pe.describe(model)["encoders"][0]["padded_outputs"] == "zeros"  # the original keeps its own setting
    same(ref, twin, 12)



@pytest.mark.parametrize("strategy", ["fixed", "min"])
def test_query_expansion_with_left_padding_matches_stock(model_dir, strategy):
    """A left-padding tokenizer puts the scored [MASK] expansion positions before the real tokens, where the packed
    layout has no values (it computes trailing masked positions only): such a call runs the stock forward, warned
    and counted, instead of returning zeros there."""
    import copy

    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    transformer = Transformer(model_dir)
    transformer.query_expansion = {"strategy": strategy, "length": 12, "attend": False}
    dense = Dense(transformer.get_embedding_dimension(), 16, bias=False, activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings", module_output_name="token_embeddings")
    ref = MultiVectorEncoder(modules=[transformer, dense, MultiVectorMask()], device="cpu")
    ref.tokenizer.padding_side = "left"
    model = pe.pack(copy.deepcopy(ref))
    queries = TEXTS[:5]
    with pytest.warns(RuntimeWarning, match="padding before the real tokens"):
        out = model.encode_query(queries, batch_size=5)
    for a, b in zip(out, ref.encode_query(queries, batch_size=5)):
        assert a.shape == b.shape and a.shape[0] >= 12
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-4)
    assert any("padding before" in r for r in pe.describe(model)["encoders"][0]["stock_forward_calls"])
    model.tokenizer.padding_side = ref.tokenizer.padding_side = "right"  # right padding stays on the packed path
    for a, b in zip(model.encode_query(queries, batch_size=5), ref.encode_query(queries, batch_size=5)):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-4)
    assert sum(pe.describe(model)["encoders"][0]["stock_forward_calls"].values()) == 1


def test_min_expansion_queries_wider_than_query_length_match_stock(model_dir):
    """strategy="min" pads short queries to its length inside a call as wide as its longest query, capped by a
    max_length the encoder may never see (the module's processing_kwargs, a per-call one, the trainer's): with
    query_length taken for the widest query call, a wider one left the short queries' [MASK] positions at zero
    (a max difference of 2.4), silently. Every width counts as a possible query call now."""
    import copy

    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    transformer = Transformer(model_dir, query_length=16, query_expansion={"strategy": "min", "length": 12},
                              processing_kwargs={"text": {"max_length": 40}})
    ref = MultiVectorEncoder(modules=[transformer, MultiVectorMask()], device="cpu")
    model = pe.pack(copy.deepcopy(ref))
    queries = ["a", "the search query " * 8]  # the long one makes the call wider than query_length
    for kwargs in ({}, {"processing_kwargs": {"text": {"max_length": 30}}}):
        got, want = model.encode_query(queries, **kwargs), ref.encode_query(queries, **kwargs)
        assert max(len(w) for w in want) > 16
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-4)


def test_query_expansion_is_followed_after_pickling(model_dir):
    """A pickled target (torch.save, the workers of start_multi_process_pool) keeps following its query expansion:
    expansion switched on after pack() and before pickling, or resized after unpickling, gives stock's outputs."""
    import copy
    import pickle

    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    transformer = Transformer(model_dir)
    dense = Dense(transformer.get_embedding_dimension(), 16, bias=False, activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings", module_output_name="token_embeddings")
    ref = MultiVectorEncoder(modules=[transformer, dense, MultiVectorMask()], device="cpu")
    packed = pe.pack(copy.deepcopy(ref))  # packed with expansion off
    queries = TEXTS[:5]
    for setting in ({"strategy": "fixed", "length": 12, "attend": False},
                    {"strategy": "fixed", "length": 20, "attend": False}):
        ref[0].query_expansion = packed[0].query_expansion = setting
        model = pickle.loads(pickle.dumps(packed))
        assert f"{setting['length']} wide" in pe.describe(model)["encoders"][0]["padded_outputs"]
        for a, b in zip(model.encode_query(queries, batch_size=5), ref.encode_query(queries, batch_size=5)):
            assert a.shape == b.shape and a.shape[0] == setting["length"]
            torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-4)
    ref[0].query_expansion = model[0].query_expansion = {"strategy": "fixed", "length": 32, "attend": False}
    for a, b in zip(model.encode_query(queries, batch_size=5), ref.encode_query(queries, batch_size=5)):
        assert a.shape == b.shape and a.shape[0] == 32
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-4)


def test_features_dict_run_through_the_model_again(model_dir):
    """sentence-transformers' modules write their outputs (token_embeddings, sentence_embedding, ...) into the features
    dict, and its Transformer module passes every feature to a forward taking ``**kwargs``: a dict that went through the
    model once carries them into the next call (CachedGISTEmbedLoss runs the model, then its guide, on one dict).
    Stock ignores them; the packed forward ignores them too and gives the same embedding."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(model_dir)
    model = pe.pack(SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                                        device="cpu"))
    features = model.preprocess(TEXTS[:4])
    with torch.no_grad():
        first = model(features)["sentence_embedding"].clone()
        assert {"token_embeddings", "sentence_embedding"} <= set(features)
        again = model(features)["sentence_embedding"]
    torch.testing.assert_close(again, first, atol=0, rtol=0)
