"""A tiny randomly initialised BERT checkpoint folder in the standard layout (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, special_tokens_map.json), its WordPiece tokenizer trained on a test
corpus with the `tokenizers` library: loaded back through the same `from_pretrained` path as a real
checkpoint, with nothing downloaded."""

from pathlib import Path

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def make_tiny_bert(folder, texts, vocab_size=120, seed=0) -> Path:
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    folder = Path(folder)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")  # fmt: skip
    fast.save_pretrained(folder)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=128, pad_token_id=tok.token_to_id("[PAD]"))  # fmt: skip
    BertModel(config).save_pretrained(folder)  # a pre-trained body without a classification head, like BERT's
    return folder
