"""``tiny-stt``: a tiny random-weight multilingual Whisper, built offline from a seed."""

from __future__ import annotations

from pathlib import Path

import torch


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    """Save a tiny random-weight multilingual Whisper (16 kHz, 80 mel bins, 30 s windows) to ``out_dir``.

    The tokenizer is byte-level BPE over the 256 byte symbols plus Whisper's special tokens in
    Whisper's order (``<|endoftext|>``, ``<|startoftranscript|>``, the language tokens, task
    tokens, ``<|startofprev|>``, ``<|notimestamps|>``) followed by the 1501 timestamp tokens.
    """
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers import WhisperProcessor, WhisperTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    text = list(dict.fromkeys(bytes_to_unicode().values()))
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    text += ["".join(m) for m in merges]
    languages = [f"<|{code}|>" for code in LANGUAGES]
    specials = ["<|endoftext|>", "<|startoftranscript|>", *languages, "<|translate|>", "<|transcribe|>",
                "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    timestamps = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    vocab = {t: i for i, t in enumerate(text + specials + timestamps)}
    ids = {t: vocab[t] for t in specials}
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges, extra_special_tokens=specials[1:])
    tokenizer.add_tokens(timestamps)

    torch.manual_seed(seed)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = WhisperConfig(
        vocab_size=len(vocab),
        num_mel_bins=80,
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=448,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=None,  # these live in the generation config
        suppress_tokens=None,
    )
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=None,
        max_new_tokens=24,  # random weights never say <|endoftext|>; keep the demo fast
        is_multilingual=True,
        lang_to_id={t: ids[t] for t in languages},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        max_initial_timestamp_index=50,
        begin_suppress_tokens=[vocab["Ġ"], eot],
        suppress_tokens=[],
    )
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(), tokenizer=tokenizer).save_pretrained(out_dir)
    return out_dir
