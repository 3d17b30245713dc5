"""The advanced series: techniques a learner meets right after the main engine (lessons 01-20)."""
