"""The tokenizers every part reads (data prep, training's callbacks, generation, evaluation,
serving): `tokenizer.prepare_tokenizer` loads one from a spec (a tokenizer.json or transformers
folder, a SentencePiece ``.model``, a tiktoken ``.tiktoken`` file or ``tiktoken:NAME``) as an
implementation of the protocol in `llmfoundry.core.tokenizer`. Below `data`, so training and
serving need nothing of data prep to read one."""
