"""The deep tier's engine: Gemma text models run from int4-stream artifacts, written for decoding."""
