"""The Hugging Face hub: choosing a repo's files, pulling them resumably into the HF cache, verifying them."""
