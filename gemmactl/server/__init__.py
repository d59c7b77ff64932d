"""The serving side: an OpenAI-compatible front over one persistent backend per tier."""
