"""Lab 10's five broken scripts and what the learner is asked about each (solutions/
lab10_bug_hunt.py; the scripts are in lib/dpcourse/scripts/lab10/): how the check runs them
(the seed, the number of ranks), the four options per bug and why each wrong one is not it,
where each bug is, and the number each bug's question asks for — with what a wrong number is
and the question a wrong line is sent back with.

Read by :mod:`dpcourse.checks.lab10` (check_line, check_answer), which exports every name here.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SCRIPT_DIR", "SCRIPTS", "SEED", "WORLD_SIZES", "CLIP", "CHOICES", "ANSWERS",
           "BUG_LINES", "ORDER_LINES", "EFFECTS", "MADE_OF", "KNOWN_EFFECTS", "LOOK_AGAIN",
           "EFFECT", "script", "show", "options", "bug_lines"]

SCRIPT_DIR = Path(__file__).resolve().parents[1] / "scripts" / "lab10"
SCRIPTS = {1: "bug1_sampler.py", 2: "bug2_loader.py", 3: "bug3_clip.py", 4: "bug4_start.py",
           5: "bug5_mean.py"}
SEED = 3  # the check's --seed: not the scripts' default, so a hard-coded seed shows
WORLD_SIZES = {1: 2, 2: 2, 3: 2, 4: 2, 5: 3}
CLIP = {3: 0.2}  # script 3 clips the gradient norm to this (after the average, when right)

# bug -> [(option, why it is not the bug, or None for the right one)]. The options are alike in
# length and form (tests/test_lab10_checks.py holds them to it), and a wrong option's sentence
# says why that option is wrong without naming the right one: the learner has already found the
# line (check_line) and now says what is wrong with it.
CHOICES = {
    1: [("A", "The ranks' shards overlap in epoch 0 only: from epoch 1 on, set_epoch reseeds "
              "every rank's sampler alike.",
         "set_epoch only sets the epoch, which each sampler adds to its own seed= when it "
         "shuffles; it never makes the ranks' seeds alike."),
        ("B", "set_epoch adds one epoch to two different seeds, so the ranks shuffle different "
              "orders in every epoch.", None),
        ("C", "Nothing broadcasts rank 0's initial weights, so each rank's replica starts from "
              "different random weights.",
         "torch.manual_seed(args.seed) seeds every rank alike right before the model is built, "
         "so every rank draws the same initial weights."),
        ("D", "Without drop_last, the sampler pads each rank's share with repeats, so some "
              "examples are read twice.",
         "DistributedSampler pads only when the data set does not split evenly over the ranks: "
         "48 examples over 2 ranks are 24 each, nothing padded.")],
    2: [("A", "The DistributedSampler is built without shuffle=True, so it deals the same "
              "order of examples in every epoch.",
         "shuffle=True is DistributedSampler's default, and set_epoch gives each epoch its own "
         "order."),
        ("B", "Two ranks of batch_size=4 make a global batch of 8, so the learning rate must "
              "double to match.",
         "scaling the learning rate with the batch is a tuning choice, not a data-parallel bug: "
         "the check compares with one device stepping with lr=0.1 on the global batch."),
        ("C", "The loader never draws from the sampler, so every rank reads all 48 examples "
              "each epoch.", None),
        ("D", "The loader shuffles with each rank's own random state, so the ranks read the "
              "examples in different orders.",
         "with no generator given, the loader's shuffle draws its seed from torch's default "
         "generator, which torch.manual_seed(args.seed) seeds alike on every rank: every rank "
         "gets the same order.")],
    3: [("A", "Each rank clips to max_norm before the average, so the averaged gradient's norm "
              "can still end up above max_norm.",
         "the mean of gradients that each have norm at most max_norm has norm at most max_norm "
         "(the norm of a sum is at most the sum of the norms): the step is bounded all the "
         "same."),
        ("B", "max_norm=0.2 is below the gradients' usual norm, so nearly every step is "
              "clipped and training stalls.",
         "how often the clip bites is a tuning choice: one device training on the global batch "
         "with max_norm=0.2 clips as often, and that run is what a correct script reproduces."),
        ("C", "The clip already scales the gradients down, so dividing their sum by world_size "
              "afterwards shrinks the step twice.",
         "dividing the sum by world_size is what makes it the mean, clip or no clip: the clip's "
         "factor max_norm / norm bounds a norm, it is not a division by world_size."),
        ("D", "Each rank bounds its own gradient's norm, which differs from bounding the norm "
              "of the averaged gradient.", None)],
    4: [("A", "Each rank seeds torch with args.seed + rank, so the ranks' tensors differ and "
              "the broadcast waits for them to agree.",
         "a broadcast carries whatever its sender holds and never compares the ranks' values: "
         "making different tensors equal is what it is for."),
        ("B", "The ranks pass different values of src, so they disagree about the root and no "
              "rank can finish the call.", None),
        ("C", "The loop broadcasts p.data, a tensor autograd does not track, and a collective "
              "waits for a parameter instead.",
         "a collective takes any dense tensor: p.data is one, the same storage as the "
         "parameter, so what it receives is written into the parameter itself."),
        ("D", "The broadcast runs right after init_process_group, before every rank is ready, "
              "so it waits forever.",
         "a collective waits until every rank of the group calls it: a rank that starts late "
         "only delays it, and every rank here does reach this broadcast.")],
    5: [("A", "dist.all_reduce averages by default, so the division after it divides the "
              "gradients a second time.",
         "dist.all_reduce sums by default (ReduceOp.SUM): what it hands back is the sum of the "
         "ranks' tensors."),
        ("B", "F.mse_loss already averages over the batch, so dividing the summed gradients by "
              "world_size makes them too small.",
         "the sum over the ranks adds world_size per-rank means: dividing that sum by "
         "world_size gives the mean over the global batch, the gradient one device steps with "
         "(the ranks' batches are equal)."),
        ("C", "The gradients are divided by world_size twice, once through the loss and once "
              "after the all-reduce.", None),
        ("D", "The loss must be all-reduced before backward, so that every rank backpropagates "
              "from the global mean.",
         "a rank's weights enter the all-reduced loss only through its own term (the other "
         "ranks' losses were computed with their replicas), so even a differentiable "
         "all_reduce leaves each rank's gradient its own.")],
}
ANSWERS = {n: next(o for o, _, why in opts if why is None) for n, opts in CHOICES.items()}

# bug -> pieces of the lines where the bug is (check_line accepts any line holding one)
BUG_LINES = {1: ("DistributedSampler(dataset",), 2: ("loader = DataLoader(",),
             3: ("clip_grad_norm_",), 4: ("dist.broadcast(",),
             5: ("yb) / world_size", "p.grad /= world_size")}
# bug -> the other side of a bug that is an ORDER of two lines: bug 3 is the clip running
# before the average, so the average's lines are a right answer too (moving the all-reduce
# above the clip is as good a repair as moving the clip down)
ORDER_LINES = {3: ("# average the gradients", "dist.all_reduce(p.grad)", "p.grad /= world_size")}
# bug -> (the question about what the script does, answered by a number worked out from its
# own lines; the answer; the tolerance; how to work it out: fail's fix=, on the second
# meeting). The number is judged before the line, so a line found by trying candidates is not
# confirmed without the fact that makes it the bug. None of these numbers is in a lesson:
# each is this script's, with the check's values (--seed 3; 2 ranks, bug 5's 3).
EFFECTS = {
    1: ("with the check's --seed 3 on 2 ranks, the sum of the three seeds that rank 1's lines "
        "pass (the data's generator, the sampler's and torch.manual_seed's), each as its line "
        "writes it", 1241, 0,
        "Read each line that seeds something with args.seed = 3 and rank = 1, and add the "
        "three seeds."),
    2: ("on 2 ranks, how many examples rank 1 reads in one epoch (a number of examples)", 48, 0,
        "Follow the examples from the data set to the batches of the loop: which object hands "
        "rank 1 its batches, and from which examples?"),
    3: ("with the section's gradients g₀ = (3, 0) on rank 0 and g₁ = (0, 1) on rank 1, and "
        "max_norm = 1, the first component of the gradient this script's opt.step() uses", 0.5,
        0.01, "Apply the script's lines in their order to (3, 0) and (0, 1): first what each "
              "rank does alone, then the sum and the division."),
    4: ("on 2 ranks, in the first dist.broadcast, how many ranks get their tensor from another "
        "rank (a sender, which keeps its own tensor, does not count)", 0, 0,
        "For each rank, read the src it passes: a rank that names itself as src sends."),
    5: ("on 3 ranks, how many times smaller the gradient opt.step() uses is than the gradient "
        "of one device's mean loss over the global batch (a factor; the same counts as 1)", 3,
        0.01, "Follow one gradient from the loss to opt.step() and count every division by "
              "world_size on the way, and what the all_reduce's sum does."),
}
# bug -> what the number is made of: said when effectN is wrong, so the sentence is about the
# number the learner worked out (a sum, a count, a ratio), not a hint at the bug
MADE_OF = {
    1: "each of the three seeds is read off its own line, with args.seed = 3 and rank = 1, "
       "before they are added",
    2: "it counts the examples rank 1's loop receives in one epoch, from whichever object hands "
       "its loader the indices",
    3: "it is the first component of what opt.step() receives once the script's lines, in "
       "their order, have run on g₀ = (3, 0) and g₁ = (0, 1) with max_norm = 1",
    4: "it counts the ranks that take the receiving side of the first dist.broadcast, given the "
       "src each rank passes",
    5: "it is how many times one device's gradient (of its mean loss over the global batch) is "
       "larger than the one opt.step() uses here, on 3 ranks",
}
# bug -> [(a wrong number a learner works out, its tolerance, what that number is)]: the
# mistakes behind a wrong effectN, named when the number gives them away
KNOWN_EFFECTS = {
    1: [(1241, 3, "close to that sum, but not it: recheck each of the three seeds, read off "
                  "its own line with args.seed = 3 and rank = 1, and the addition")],
    2: [(24, 0, "24 is what rank 1 would read if its loader drew its indices from the "
                "DistributedSampler (48 over 2 ranks), so follow which object this loader "
                "draws from"),
        (12, 0, "12 is a count of batches of 4, not of examples (and of a rank's half)")],
    3: [(3 / 10 ** 0.5, 0.01, "that is the first component one device steps with (the mean "
                              "(1.5, 0.5), then one clip of its norm 1.58 down to 1); the "
                              "question asks what this script's lines do, in their order"),
        (1.5, 0.01, "that is the mean with no clipping at all, and the script clips"),
        (1, 0.01, "that is rank 0's clipped gradient alone, before the lines that follow the "
                  "clip")],
    4: [(1, 0, "1 is what a broadcast does when every rank names the same src: one sender and "
               "world_size − 1 = 1 receiver. Read the src each rank passes here, with its own "
               "rank"),
        (2, 0, "2 would mean both ranks receive, and no rank sends")],
    5: [(9, 0.01, "9 counts the two divisions by 3 and leaves out the all_reduce, whose sum "
                  "multiplies by 3"),
        (2, 0.01, "2 is not a factor any line applies here: this script runs on 3 ranks "
                  "(world_size = 3, not the 2 of scripts 1 to 4), and two, the number of "
                  "divisions on the way, is not the factor they make together with the "
                  "all_reduce's sum"),
        (1 / 3, 0.01, "1/3 would make the step 3 times larger; the question asks how many "
                      "times smaller: a factor, not a fraction"),
        (1, 0.01, "1 says the step uses one device's gradient: count every division by "
                  "world_size and every sum between the loss and opt.step()")],
}
# bug -> the question a learner who picked another line is sent back with (never the answer)
LOOK_AGAIN = {
    1: "ask which examples each rank's loader yields in one epoch, and whether the ranks "
       "together read the data set exactly once",
    2: "ask which examples each rank reads in one epoch, and which object decides that",
    3: "ask, for each line of the step, whether it sees this rank's own gradient or the "
       "average over the ranks",
    4: "ask what each rank does in the first collective it calls, and which rank sends",
    5: "follow one gradient from the loss to opt.step() and count what it is divided by",
}
# bug -> what a learner who has tried lines one by one is asked to predict of the next line
# (fail's fix=: it joins the sentence from the second wrong line for the same bug on)
EFFECT = {
    1: "which examples each rank then reads in one epoch",
    2: "which examples each rank then reads, and in which order",
    3: "which gradient it then changes, and whether one device would change the same one",
    4: "what each rank then does in that call, and which rank receives",
    5: "what each gradient is then divided by, counted all the way to opt.step()",
}


def script(n: int) -> str:
    """The text of broken script ``n`` (1 to 5)."""
    if n not in SCRIPTS:
        raise ValueError(f"there are five scripts, 1 to 5; got {n!r}")
    return (SCRIPT_DIR / SCRIPTS[n]).read_text()


def show(n: int) -> None:
    """Print script ``n`` with line numbers (the options come after :func:`check_line`)."""
    print(f"--- {SCRIPTS[n]} ---")
    for i, line in enumerate(script(n).splitlines(), 1):
        print(f"{i:3d}  {line}")


def options(n: int) -> None:
    """Print the four options for bug ``n``."""
    if n not in CHOICES:
        raise ValueError(f"there are five bugs, 1 to 5; got {n!r}")
    print(f"What is wrong in {SCRIPTS[n]}?")
    for option, text, _ in CHOICES[n]:
        print(f"  {option}. {text}")


def bug_lines(n: int) -> list[int]:
    """The line numbers (as :func:`show` prints them) where bug ``n`` is."""
    return [i for i, line in enumerate(script(n).splitlines(), 1)
            if any(piece in line for piece in BUG_LINES[n])]


def _is_number(value) -> bool:
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool)
