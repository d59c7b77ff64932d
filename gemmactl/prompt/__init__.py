"""Prompt text in and out: building a model's prompt from messages, stop strings, thinking markup."""
