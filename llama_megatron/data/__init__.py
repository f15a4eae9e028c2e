"""The data path: tokenizers, Megatron .bin/.idx files, preprocessing, GPT sample datasets (docs/data.md).

tokenizer (load_tokenizer) · indexed_dataset (MMapIndexedDataset, IndexedDatasetWriter) · preprocess and
train_tokenizer (CLI verbs) · gpt_dataset (build_train_valid_test_datasets, validate_data_config) · sampler
(PretrainingSampler, make_sample_iterator) · synthetic · blended_dataset · sample_index · index_cache · readers ·
sp_fastpath · progress.
"""
