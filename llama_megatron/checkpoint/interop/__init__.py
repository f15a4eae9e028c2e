"""Interoperability: Hugging Face, Meta and PEFT checkpoints read and written, and the conversions between them and
our format (checkpoint/)."""
