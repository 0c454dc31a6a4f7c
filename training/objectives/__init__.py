"""What the last pipeline stage computes from a micro-batch's logits: the LM loss, DPO's, the reference pass's.

Each is an `parallel.step.Objective`; the engine calls it with the layout's token loss and the micro-batch's payload
(`MicroBatch.extra`), so none of them knows the pipeline or TP, and `parallel/` knows none of them."""
