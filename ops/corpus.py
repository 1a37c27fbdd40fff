"""Public-domain English text that benchmark prompts are cut from (shipped, never downloaded).

Passages: Jane Austen, "Pride and Prejudice" (1813), chapter 1; Herman Melville,
"Moby-Dick" (1851), from chapter 1; Charles Dickens, "A Tale of Two Cities" (1859),
opening; Lewis Carroll, "Alice's Adventures in Wonderland" (1865), from chapter 1;
Abraham Lincoln, the Gettysburg Address (1863).
"""

PASSAGES: tuple[str, ...] = (
    """It is a truth universally acknowledged, that a single man in possession of a good \
fortune, must be in want of a wife. However little known the feelings or views of such a man \
may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the \
surrounding families, that he is considered the rightful property of some one or other of \
their daughters. "My dear Mr. Bennet," said his lady to him one day, "have you heard that \
Netherfield Park is let at last?" Mr. Bennet replied that he had not. "But it is," returned \
she; "for Mrs. Long has just been here, and she told me all about it." Mr. Bennet made no \
answer. "Do you not want to know who has taken it?" cried his wife impatiently. "You want to \
tell me, and I have no objection to hearing it." This was invitation enough. "Why, my dear, \
you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune from \
the north of England; that he came down on Monday in a chaise and four to see the place, and \
was so much delighted with it, that he agreed with Mr. Morris immediately; that he is to take \
possession before Michaelmas, and some of his servants are to be in the house by the end of \
next week." "What is his name?" "Bingley." "Is he married or single?" "Oh! Single, my dear, \
to be sure! A single man of large fortune; four or five thousand a year. What a fine thing \
for our girls!" "How so? How can it affect them?" "My dear Mr. Bennet," replied his wife, \
"how can you be so tiresome! You must know that I am thinking of his marrying one of them." \
"Is that his design in settling here?" "Design! Nonsense, how can you talk so! But it is very \
likely that he may fall in love with one of them, and therefore you must visit him as soon as \
he comes." "I see no occasion for that. You and the girls may go, or you may send them by \
themselves, which perhaps will be still better, for as you are as handsome as any of them, \
Mr. Bingley may like you the best of the party." "My dear, you flatter me. I certainly have \
had my share of beauty, but I do not pretend to be anything extraordinary now. When a woman \
has five grown-up daughters, she ought to give over thinking of her own beauty." "In such \
cases, a woman has not often much beauty to think of." "But, my dear, you must indeed go and \
see Mr. Bingley when he comes into the neighbourhood." "It is more than I engage for, I \
assure you." "But consider your daughters. Only think what an establishment it would be for \
one of them. Sir William and Lady Lucas are determined to go, merely on that account, for in \
general, you know, they visit no newcomers. Indeed you must go, for it will be impossible for \
us to visit him if you do not." "You are over-scrupulous, surely. I dare say Mr. Bingley will \
be very glad to see you; and I will send a few lines by you to assure him of my hearty \
consent to his marrying whichever he chooses of the girls; though I must throw in a good word \
for my little Lizzy." "I desire you will do no such thing. Lizzy is not a bit better than the \
others; and I am sure she is not half so handsome as Jane, nor half so good-humoured as \
Lydia. But you are always giving her the preference." "They have none of them much to \
recommend them," replied he; "they are all silly and ignorant like other girls; but Lizzy has \
something more of quickness than her sisters." "Mr. Bennet, how can you abuse your own \
children in such a way? You take delight in vexing me. You have no compassion for my poor \
nerves." "You mistake me, my dear. I have a high respect for your nerves. They are my old \
friends. I have heard you mention them with consideration these last twenty years at least." \
Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice, that \
the experience of three-and-twenty years had been insufficient to make his wife understand \
his character. Her mind was less difficult to develop. She was a woman of mean understanding, \
little information, and uncertain temper. When she was discontented, she fancied herself \
nervous. The business of her life was to get her daughters married; its solace was visiting \
and news.""",
    """Call me Ishmael. Some years ago, never mind how long precisely, having little or no \
money in my purse, and nothing particular to interest me on shore, I thought I would sail \
about a little and see the watery part of the world. It is a way I have of driving off the \
spleen and regulating the circulation. Whenever I find myself growing grim about the mouth; \
whenever it is a damp, drizzly November in my soul; whenever I find myself involuntarily \
pausing before coffin warehouses, and bringing up the rear of every funeral I meet; and \
especially whenever my hypos get such an upper hand of me, that it requires a strong moral \
principle to prevent me from deliberately stepping into the street, and methodically knocking \
people's hats off, then, I account it high time to get to sea as soon as I can. This is my \
substitute for pistol and ball. With a philosophical flourish Cato throws himself upon his \
sword; I quietly take to the ship. There is nothing surprising in this. If they but knew it, \
almost all men in their degree, some time or other, cherish very nearly the same feelings \
towards the ocean with me. There now is your insular city of the Manhattoes, belted round by \
wharves as Indian isles by coral reefs; commerce surrounds it with her surf. Right and left, \
the streets take you waterward. Its extreme downtown is the battery, where that noble mole is \
washed by waves, and cooled by breezes, which a few hours previous were out of sight of land. \
Look at the crowds of water-gazers there. Circumambulate the city of a dreamy Sabbath \
afternoon. Go from Corlears Hook to Coenties Slip, and from thence, by Whitehall, northward. \
What do you see? Posted like silent sentinels all around the town, stand thousands upon \
thousands of mortal men fixed in ocean reveries. Some leaning against the spiles; some seated \
upon the pier-heads; some looking over the bulwarks of ships from China; some high aloft in \
the rigging, as if striving to get a still better seaward peep. But these are all landsmen; \
of week days pent up in lath and plaster, tied to counters, nailed to benches, clinched to \
desks. How then is this? Are the green fields gone? What do they here? But look! here come \
more crowds, pacing straight for the water, and seemingly bound for a dive. Strange! Nothing \
will content them but the extremest limit of the land; loitering under the shady lee of yonder \
warehouses will not suffice. No. They must get just as nigh the water as they possibly can \
without falling in. And there they stand, miles of them, leagues. Inlanders all, they come \
from lanes and alleys, streets and avenues, north, east, south, and west. Yet here they all \
unite. Tell me, does the magnetic virtue of the needles of the compasses of all those ships \
attract them thither? Once more. Say you are in the country; in some high land of lakes. Take \
almost any path you please, and ten to one it carries you down in a dale, and leaves you there \
by a pool in the stream. There is magic in it. Let the most absent-minded of men be plunged in \
his deepest reveries, stand that man on his legs, set his feet a-going, and he will infallibly \
lead you to water, if water there be in all that region. Should you ever be athirst in the \
great American desert, try this experiment, if your caravan happen to be supplied with a \
metaphysical professor. Yes, as every one knows, meditation and water are wedded for ever.""",
    """It was the best of times, it was the worst of times, it was the age of wisdom, it was \
the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was \
the season of Light, it was the season of Darkness, it was the spring of hope, it was the \
winter of despair, we had everything before us, we had nothing before us, we were all going \
direct to Heaven, we were all going direct the other way; in short, the period was so far \
like the present period, that some of its noisiest authorities insisted on its being \
received, for good or for evil, in the superlative degree of comparison only. There were a \
king with a large jaw and a queen with a plain face, on the throne of England; there were a \
king with a large jaw and a queen with a fair face, on the throne of France. In both \
countries it was clearer than crystal to the lords of the State preserves of loaves and \
fishes, that things in general were settled for ever. It was the year of Our Lord one \
thousand seven hundred and seventy-five. Spiritual revelations were conceded to England at \
that favoured period, as at this. France, less favoured on the whole as to matters spiritual \
than her sister of the shield and trident, rolled with exceeding smoothness down hill, making \
paper money and spending it. It is likely enough that, rooted in the woods of France and \
Norway, there were growing trees, when that sufferer was put to death, already marked by the \
Woodman, Fate, to come down and be sawn into boards, to make a certain movable framework with \
a sack and a knife in it, terrible in history. It is likely enough that in the rough \
outhouses of some tillers of the heavy lands adjacent to Paris, there were sheltered from the \
weather that very day, rude carts, bespattered with rustic mire, snuffed about by pigs, and \
roosted in by poultry, which the Farmer, Death, had already set apart to be his tumbrils of \
the Revolution. But that Woodman and that Farmer, though they work unceasingly, work \
silently, and no one heard them as they went about with muffled tread.""",
    """Alice was beginning to get very tired of sitting by her sister on the bank, and of \
having nothing to do: once or twice she had peeped into the book her sister was reading, but \
it had no pictures or conversations in it, "and what is the use of a book," thought Alice, \
"without pictures or conversations?" So she was considering in her own mind (as well as she \
could, for the hot day made her feel very sleepy and stupid), whether the pleasure of making a \
daisy-chain would be worth the trouble of getting up and picking the daisies, when suddenly a \
White Rabbit with pink eyes ran close by her. There was nothing so very remarkable in that; \
nor did Alice think it so very much out of the way to hear the Rabbit say to itself, "Oh \
dear! Oh dear! I shall be late!" (when she thought it over afterwards, it occurred to her \
that she ought to have wondered at this, but at the time it all seemed quite natural); but \
when the Rabbit actually took a watch out of its waistcoat-pocket, and looked at it, and then \
hurried on, Alice started to her feet, for it flashed across her mind that she had never \
before seen a rabbit with either a waistcoat-pocket, or a watch to take out of it, and \
burning with curiosity, she ran across the field after it, and fortunately was just in time \
to see it pop down a large rabbit-hole under the hedge. In another moment down went Alice \
after it, never once considering how in the world she was to get out again. The rabbit-hole \
went straight on like a tunnel for some way, and then dipped suddenly down, so suddenly that \
Alice had not a moment to think about stopping herself before she found herself falling down \
a very deep well. Either the well was very deep, or she fell very slowly, for she had plenty \
of time as she went down to look about her and to wonder what was going to happen next. \
First, she tried to look down and make out what she was coming to, but it was too dark to see \
anything; then she looked at the sides of the well, and noticed that they were filled with \
cupboards and book-shelves; here and there she saw maps and pictures hung upon pegs. She took \
down a jar from one of the shelves as she passed; it was labelled "ORANGE MARMALADE", but to \
her great disappointment it was empty: she did not like to drop the jar for fear of killing \
somebody underneath, so managed to put it into one of the cupboards as she fell past it.""",
    """Four score and seven years ago our fathers brought forth on this continent, a new \
nation, conceived in Liberty, and dedicated to the proposition that all men are created \
equal. Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. \
We have come to dedicate a portion of that field, as a final resting place for those who here \
gave their lives that that nation might live. It is altogether fitting and proper that we \
should do this. But, in a larger sense, we can not dedicate, we can not consecrate, we can \
not hallow this ground. The brave men, living and dead, who struggled here, have consecrated \
it, far above our poor power to add or detract. The world will little note, nor long \
remember what we say here, but it can never forget what they did here. It is for us the \
living, rather, to be dedicated here to the unfinished work which they who fought here have \
thus far so nobly advanced. It is rather for us to be here dedicated to the great task \
remaining before us, that from these honored dead we take increased devotion to that cause \
for which they gave the last full measure of devotion, that we here highly resolve that these \
dead shall not have died in vain, that this nation, under God, shall have a new birth of \
freedom, and that government of the people, by the people, for the people, shall not perish \
from the earth.""",
)


def full_text() -> str:
    """All passages as one text, paragraphs separated by a blank line."""
    return "\n\n".join(PASSAGES)
