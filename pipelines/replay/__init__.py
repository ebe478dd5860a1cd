"""Shadow replay's floor: read a traffic log (traffic), run one model over it (engine), compare it with fp16
(agreement). The stage pipelines/shadow.py puts them together."""
