"""Synthetic and packaged corpora for demos and tests, images and videos."""
