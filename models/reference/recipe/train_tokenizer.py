"""Train the byte-level BPE tokenizer (vocab 4096, <|endoftext|> = id 0) on the training split."""
import argparse
import json
import os

from common import EOT, TOKENIZER_DIR, VOCAB_SIZE, iter_texts, list_files


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=TOKENIZER_DIR)
    args = ap.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train, held = list_files()
    texts = [t for _, t in iter_texts(train)]
    print(f"train files: {len(train)} ({len(texts)} utf-8), held-out: {[r for r, _ in held]}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOT) == 0 and tok.get_vocab_size() == VOCAB_SIZE
    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT, "eos_token": EOT, "pad_token": EOT, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
        fh.write("\n")
    # exact round trip on every file
    bad = 0
    for _, t in iter_texts(train + held):
        if tok.decode(tok.encode(t).ids, skip_special_tokens=False) != t:
            bad += 1
    print("round-trip failures:", bad)
    assert bad == 0


if __name__ == "__main__":
    main()
