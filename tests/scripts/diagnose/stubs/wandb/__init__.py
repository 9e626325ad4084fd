"""A stand-in for Weights & Biases (``wandb``), which the course does not install: the same
names a training script calls, recording nothing. tests/scripts/diagnose/writer_every_rank.py
puts this folder first on ``sys.path``; diagnose must treat it as it would the real package."""


class Run:
    def log(self, data, step=None):
        pass

    def finish(self):
        pass


run = None


def init(project=None, config=None, **kwargs):
    global run
    run = Run()
    return run


def log(data, step=None):
    run.log(data, step)


def finish():
    run.finish()
