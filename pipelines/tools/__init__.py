"""Tools beside the data path: synthetic logs (``userwise synth``) and the demo (``make demo``)."""
