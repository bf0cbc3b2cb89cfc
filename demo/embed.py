"""``tiny-embed``: a 2-layer random-weight BERT encoder with a WordPiece tokenizer made offline,
saved in sentence-transformers' folder format (mean pooling, normalized), built from a seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONTEXT = 128  # tokens per input, [CLS] and [SEP] included

_CORPUS = [
    "tiergate turns text into vectors for search, clustering and retrieval on one shared GPU.",
    "Paid requests come first, then subscribers, then free traffic; batch work waits for idle time.",
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Similar sentences should land near each other; a random model places them anywhere.",
] * 20


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    """Save ``tiny-embed`` to ``out_dir``: encoder and tokenizer, ``modules.json`` (Transformer,
    Pooling, Normalize), ``1_Pooling/config.json`` (mean) and ``sentence_bert_config.json``."""
    out_dir = Path(out_dir)
    model, _ = tiny_bert(out_dir, seed, "BertModel")
    model.save_pretrained(out_dir)  # with its (unused) pooler, as real checkpoints ship it
    config = model.config

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    pooling = {"word_embedding_dimension": config.hidden_size, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               "pooling_mode_lasttoken": False, "include_prompt": True}
    _write(out_dir / "modules.json", modules)
    _write(out_dir / "1_Pooling" / "config.json", pooling)
    (out_dir / "2_Normalize").mkdir(exist_ok=True)
    _write(out_dir / "sentence_bert_config.json", {"max_seq_length": CONTEXT, "do_lower_case": False})
    return out_dir


def tiny_bert(out_dir: Path, seed: int, model_class: str = "BertForSequenceClassification",
              **config: Any) -> tuple[Any, Any]:
    """A 2-layer random-weight BERT (transformers' ``model_class``: the encoder, or a sequence
    classifier whose labels ``config`` gives: ``id2label``, ``num_labels``, ``problem_type``...),
    built from ``seed``, and the WordPiece tokenizer, which is saved in ``out_dir``; the model is
    the caller's to adjust and save. tiny-embed, tiny-moderation and tiny-rerank are made so."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = wordpiece_tokenizer()
    tokenizer.save_pretrained(out_dir)
    torch.manual_seed(seed)
    bert = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=CONTEXT, pad_token_id=tokenizer.pad_token_id, **config,
    )
    return getattr(transformers, model_class)(bert).eval(), tokenizer


def wordpiece_tokenizer(context: int = CONTEXT):
    """A BERT-style WordPiece tokenizer (lowercased, [CLS] text [SEP]) over a vocabulary made
    from a small corpus: its characters, alone and as word pieces (``##e``), and its words whole;
    ``context`` tokens per input. Made, not trained: tokenizers' WordPiece trainer breaks ties
    between merges as frequent as each other in hash order, so two builds had different
    vocabularies (249 or 250 tokens, different ids), and so different models from one seed."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    normalizer, splitter = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words = sorted({w for line in _CORPUS for w, _ in splitter.pre_tokenize_str(normalizer.normalize_str(line))})
    chars = sorted({c for w in words for c in w})
    vocab = specials + chars + [f"##{c}" for c in chars] + [w for w in words if len(w) > 1]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = splitter
    tok.decoder = decoders.WordPiece()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=context,
    )


def _write(file: Path, data: object) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(data, indent=2) + "\n")
