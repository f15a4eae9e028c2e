"""The chat data path: SFT records (four formats) and preference pairs rendered with chat templates, tokenised into
token and mask shards, and read as padded or packed rows."""
