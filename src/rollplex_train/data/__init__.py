"""Datasets, image/video loading and patchifying, prompt building, collation."""
