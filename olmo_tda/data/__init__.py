"""Training data as answers name it: OLMo memmap files, their documents and sources, and
``prepare`` (text/JSONL files to memmaps with a document index).

Example::

    from olmo_tda.data import Corpus, prepare
    from olmo_tda.demo.corpus import ByteTokenizer
    tok = ByteTokenizer()
    paths = prepare(["facts.jsonl"], "data", encode=tok.encode, eos_token_id=tok.eos_token_id)
    corpus = Corpus(paths, seq_len=128, eos_token_id=tok.eos_token_id, decode=tok.decode)
    print(corpus.num_documents, corpus.document_name(0), corpus.document_text(0))
"""

from .corpus import DOCS_SUFFIX, Corpus, write_document_index
from .prepare import prepare, read_documents

__all__ = ["Corpus", "DOCS_SUFFIX", "prepare", "read_documents", "write_document_index"]
