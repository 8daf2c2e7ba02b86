"""Graph passes on the Dynamo graph. One pass per file, except the attention rewrite: `mla_attention` (the driver)
with `attention_match`, `attention_mask`, `attention_emit`, `attention_checks` and `dsa_indexer`.
`manager.PassManager` runs them in order (`backend.build_pass_manager`) and keys Inductor's caches on their code."""
