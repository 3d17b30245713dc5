"""Lesson 14: one batched (varlen) forward over paged KV, no Python loop over sequences."""
